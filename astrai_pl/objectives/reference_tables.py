"""Reference log-probabilities computed once before training, kept as tables keyed by each row's `row_index`.

An objective with `precompute_ref_log_probs` (DPO, KTO) scores every row of the train and val splits under the
initial policy (its LoRA adapter switched off) before the first step, and keeps no reference model: a step reads
its batch's rows from the table instead of running a second forward. The tables travel in checkpoints, so a
resumed run reads the same numbers. A data module offers `indexed_loaders()` (every row of each split once, on
every rank, with the collation of training) for this.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import nn

from ..checkpoint import CheckpointError
from ..model.config import ConfigError
from .base import check_reference_fingerprint, reference_scope

TABLE_OF_STAGE = {"train": "train", "val": "val", "test": "val"}  # which precomputed table a stage reads
Scorer = Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor]  # (model, batch) -> (B, C)


@torch.no_grad()
def reference_table(model: nn.Module, loader: Any, device: torch.device, score: Scorer) -> torch.Tensor:
    """`score(model, batch)` of every row of `loader`, at its `row_index`, in eval mode.  (N, C)"""
    was_training = model.training
    model.eval()
    table = None
    try:
        for batch in loader:
            batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
            scores = score(model, batch).float().cpu()  # (B, C)
            if table is None:
                table = torch.full((len(loader.dataset), scores.shape[1]), math.nan)
            table[batch["row_index"].cpu()] = scores
    finally:
        model.train(was_training)
    assert table is not None and not table.isnan().any(), "the loader did not cover every row index"
    return table


def prepared_tables(objective: Any, tables: dict[str, torch.Tensor] | None, score: Scorer
                    ) -> dict[str, torch.Tensor]:
    """The objective's tables before its first step: scored now (`precompute_tables`), or, when it already holds
    some (read from a checkpoint), those, once they are found to have one row per row of its data's splits."""
    loaders = indexed_loaders(objective)
    if tables is None:
        return precompute_tables(objective, loaders, score)
    for split, loader in loaders.items():
        table = tables.get(split) if isinstance(tables, dict) else None
        if not (isinstance(table, torch.Tensor) and table.is_floating_point() and table.dim() == 2
                and len(table) == len(loader.dataset) and bool(table.isfinite().all())):
            held = f"a table of shape {tuple(table.shape)}" if isinstance(table, torch.Tensor) else repr(type(table))
            raise CheckpointError(f"the checkpoint's precomputed reference log-probabilities for the {split} split "
                                  f"are {held}, and the data has {len(loader.dataset)} rows there (finite floats, "
                                  "one row each): it was trained on other data, or the file is damaged. Fix: "
                                  "resume with the data it was trained on, or start a new run")
    return tables


def indexed_loaders(objective: Any) -> dict[str, Any]:
    """Every row of each split of the objective's data module, once; ConfigError when it cannot list them."""
    datamodule = objective.trainer.datamodule
    if not hasattr(datamodule, "indexed_loaders"):
        raise ConfigError(f"{type(objective).__name__}.precompute_ref_log_probs=True needs a data module with "
                          f"indexed_loaders() (DPOData, KTOData), got {type(datamodule).__name__}; pass one as the "
                          "datamodule or set precompute_ref_log_probs to false")
    return datamodule.indexed_loaders()


def precompute_tables(objective: Any, loaders: dict[str, Any], score: Scorer) -> dict[str, torch.Tensor]:
    """One table per split (`loaders`: "train", "val"), scored by the model as its reference (adapters off) under
    the trainer's precision."""
    name = type(objective).__name__
    with objective.trainer.precision_plugin.forward_context(), reference_scope(objective.model):
        tables = {split: reference_table(objective.model, loader, objective.device, score)
                  for split, loader in loaders.items()}
    sizes = ", ".join(f"{len(t)} {split}" for split, t in tables.items())
    rank_zero_info(f"{name}: reference log-probabilities precomputed for {sizes} rows")
    return tables


def table_rows(tables: dict[str, torch.Tensor] | None, batch: dict[str, torch.Tensor], stage: str, name: str,
               device: torch.device) -> torch.Tensor:
    """The rows of `batch` (its `row_index`) in the table of `stage`.  (B, C)"""
    if tables is None or "row_index" not in batch:
        raise ConfigError(f"{name}.precompute_ref_log_probs=True needs its table filled before the first step and "
                          "batches with 'row_index': pass DPOData / KTOData as the datamodule of fit, validate or "
                          "test")
    return tables[TABLE_OF_STAGE[stage]][batch["row_index"].cpu()].to(device)


def save_reference(objective: Any, checkpoint: dict[str, Any]) -> None:
    """What a checkpoint keeps of the objective's reference (DPO, KTO): its precomputed tables, or the fingerprint
    of its frozen copy's weights."""
    if objective.reference_logps is not None:
        checkpoint["reference_logps"] = objective.reference_logps
    if objective.reference_fingerprint is not None:
        checkpoint["reference_fingerprint"] = objective.reference_fingerprint


def load_reference(objective: Any, checkpoint: dict[str, Any]) -> None:
    """With precompute_ref_log_probs, the checkpoint's tables into the objective (CheckpointError when it was
    trained with a live reference); else the checkpoint's reference fingerprint checked against the objective's."""
    if objective.hparams.precompute_ref_log_probs:
        if "reference_logps" not in checkpoint:
            raise CheckpointError("this checkpoint holds no precomputed reference log-probabilities (it was trained "
                                  "with a live reference); resume it with precompute_ref_log_probs false")
        objective.reference_logps = checkpoint["reference_logps"]
        return
    check_reference_fingerprint(checkpoint.get("reference_fingerprint"), objective.reference_fingerprint,
                                objective.hparams.init_from)
