"""KTOData: unpaired examples — a prompt, a completion and a desirable/undesirable label — padded per batch,
with the mismatched (prompt, completion) pairs KTO estimates its KL reference point from."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import numpy as np
import torch
from datasets import Dataset
from torch.utils.data import DataLoader

from .base import RowsData
from .dpo import _labels, check_length_options
from .packing import IGNORE_INDEX, row_lengths
from .preflight import check_trained_tokens, describe_example
from .sampling import resumable_loader
from .sources import Encoded, announce
from .windows import windowed

KTO_COLUMNS = ("input_ids", "loss_mask", "prompt_length", "label")


def examples_in(batch: dict[str, Any]) -> int:
    """Examples in a batch (rows of `input_ids`)."""
    return int(batch["input_ids"].shape[0])


def mismatched(rows: Sequence[dict[str, Any]]) -> list[tuple[list[int], list[int]]]:
    """(ids, mask) of each row's prompt followed by the previous row's completion (the first row takes the last
    one's): the batch's completions, each under another prompt, as the KTO paper estimates KL(π ‖ π_ref) from."""
    out = []
    for i, row in enumerate(rows):
        other = rows[i - 1]
        p, q = row["prompt_length"], other["prompt_length"]
        out.append((row["input_ids"][:p] + other["input_ids"][q:], row["loss_mask"][:p] + other["loss_mask"][q:]))
    return out


def with_mismatched_pairs(rows: Dataset) -> Dataset:
    """`rows` with `KL_input_ids` and `KL_loss_mask`: each row's prompt followed by the previous row's completion
    of the split (`mismatched` over the whole split). A pair fixed per row, as TRL's KL dataset is, is what lets
    the reference's log-probabilities of the pairs be computed once (KTO's precompute_ref_log_probs)."""
    pairs = mismatched(rows.select_columns(["input_ids", "loss_mask", "prompt_length"]).to_list())
    rows = rows.add_column("KL_input_ids", [ids for ids, _ in pairs])
    return rows.add_column("KL_loss_mask", [mask for _, mask in pairs])


def collate_unpaired(rows: Sequence[dict[str, Any]], pad_id: int, max_seq_len: int) -> dict[str, torch.Tensor]:
    """The examples and their mismatched pairs, cut to max_seq_len and right-padded to one width T.

    Returns `input_ids` and `labels` (B, T) — labels are the tokens where the loss mask is 1 (the completion)
    and -100 elsewhere — `KL_input_ids` and `KL_labels` (B, T): each row's own mismatched pair when the rows
    carry one (`with_mismatched_pairs`), else its prompt with the previous row's completion (`mismatched`),
    `label` (B,) bool (True: desirable) and `row_index` (B,) when the rows carry it. With one width the
    objective can stack both into a single (2B, T) forward.
    """
    fixed = "KL_input_ids" in rows[0]
    kl = [(r["KL_input_ids"], r["KL_loss_mask"]) for r in rows] if fixed else mismatched(rows)
    sides = {"": [(r["input_ids"], r["loss_mask"]) for r in rows], "KL_": kl}
    cut = {k: [(ids[:max_seq_len], mask[:max_seq_len]) for ids, mask in v] for k, v in sides.items()}
    width = max(len(ids) for v in cut.values() for ids, _ in v)
    batch: dict[str, torch.Tensor] = {}
    for prefix, pairs in cut.items():
        batch[f"{prefix}input_ids"] = torch.tensor([ids + [pad_id] * (width - len(ids)) for ids, _ in pairs])
        batch[f"{prefix}labels"] = torch.tensor(
            [_labels(ids, mask) + [IGNORE_INDEX] * (width - len(ids)) for ids, mask in pairs])
    batch["label"] = torch.tensor([bool(r["label"]) for r in rows], dtype=torch.bool)
    if "row_index" in rows[0]:
        batch["row_index"] = torch.tensor([r["row_index"] for r in rows], dtype=torch.long)
    return batch


class KTOData(RowsData):
    """Unpaired examples for KTO: rows `prompt`, `completion` (text or messages) and `label` (true: desirable).

    Train batches carry `window_examples` (the examples of their accumulation window), with which the objective
    makes its per-example mean exact under gradient accumulation. Each batch also holds every example's
    mismatched pair (its prompt with the completion of the example before it in its split, fixed per example as
    TRL's KL dataset is): KTO's KL estimate averages them over a batch, so it needs batches of at least 2
    examples. Every batch carries `row_index` (the example's position in its split). The desirable/undesirable
    counts of each split are logged.
    """

    kind = "kto"

    def __init__(self, *, max_seq_len: int = 512, truncation: str = "right", **kwargs: Any):
        """
        Args:
            max_seq_len: Longest prompt + completion; longer sequences are cut or dropped.
            truncation: 'right' (cut the completion's tail) or 'drop' (drop the example). Counts are logged.
            **kwargs: The options every post-training data module shares (path, tokenizer, sections, split,
                val_split, val_fraction, on_bad_row, batch_size, num_proc, num_workers, cache_dir, seed,
                synthetic): see `RowsData`.
        """
        check_length_options("KTOData", max_seq_len, truncation,
                             "cutting the left side would change the prompt")
        super().__init__(**kwargs)

    def _build(self, splits: dict[str, Encoded]) -> None:
        self.train_set, self.val_set = (self._trainable(name, splits[name]) for name in ("train", "val"))
        announce("KTOData: a training example (trained tokens in [[ ]]):",
                 describe_example(self.train_set, self.tokenizer, 0, "input_ids", "loss_mask"))

    def _trainable(self, name: str, encoded: Encoded) -> Dataset:
        """Examples that keep a trained token within max_seq_len (and fit it, for 'drop'), with their row index."""
        hp = self.hparams
        keep = check_trained_tokens(encoded.rows, hp.max_seq_len, "none", hp.truncation, source=encoded.name,
                                    lines=encoded.lines, on_bad_row=hp.on_bad_row, dropped=encoded.dropped)
        if hp.truncation == "drop":
            long = row_lengths(encoded.rows, "input_ids") > hp.max_seq_len
            announce(f"KTOData {encoded.name}: {int(long.sum())} example(s) longer than max_seq_len="
                     f"{hp.max_seq_len} dropped")
            encoded.dropped[f"longer than max_seq_len={hp.max_seq_len} (truncation='drop')"] += int(long.sum())
            keep = np.intersect1d(keep, np.flatnonzero(~long))
        self._require(len(keep), f"{name} examples", encoded)
        rows = encoded.rows.select_columns(list(KTO_COLUMNS))
        rows = rows if len(keep) == len(rows) else rows.select(keep)
        desirable = int(np.sum(rows["label"]))
        announce(f"KTOData {encoded.name}: {desirable} desirable, {len(rows) - desirable} undesirable")
        return with_mismatched_pairs(rows.add_column("row_index", np.arange(len(rows))))

    def _loader(self, dataset: Dataset, **kwargs) -> DataLoader:
        collate = partial(collate_unpaired, pad_id=self.tokenizer.pad_token_id, max_seq_len=self.hparams.max_seq_len)
        return DataLoader(dataset.with_format(None), batch_size=self.hparams.batch_size, collate_fn=collate,
                          num_workers=self.hparams.num_workers, **kwargs)

    def train_dataloader(self):
        hp = self.hparams
        collate = partial(collate_unpaired, pad_id=self.tokenizer.pad_token_id, max_seq_len=hp.max_seq_len)
        loader = resumable_loader(self.train_set.with_format(None), hp.batch_size, hp.seed, self.trainer, collate,
                                  num_workers=hp.num_workers)
        return windowed(loader, self.trainer, examples_in, "window_examples")

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set)

    def indexed_loaders(self) -> dict[str, DataLoader]:
        """Every example of each split ("train", "val") once, in row order and on every rank: what a table keyed
        by `row_index` is filled from (KTO's precompute_ref_log_probs). The test loader is "val"."""
        self._prepare()
        return {"train": self._loader(self.train_set), "val": self._loader(self.val_set)}

    test_dataloader = val_dataloader
