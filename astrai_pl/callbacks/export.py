"""Hugging Face exports during and after training: safetensors weights, config.json,
generation_config.json and the tokenizer's files, in a folder `transformers` and `Transformer.from_pretrained`
load. Under FSDP2 / tensor parallel the full weights are gathered first (every rank takes part); rank 0
writes. `save_pretrained` writes into a temporary folder and renames it, so an export is never half there.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import lightning as L
import torch

from ..checkpoint.lora_base import peft_base
from ..model import Transformer
from ..model.lora import apply_lora


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded weights on CPU (on rank 0; other ranks of a sharded model get an empty dict).
    Collective when the parameters are DTensors: call it on every rank."""
    if not any(type(p).__name__ == "DTensor" for p in model.parameters()):
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def export_pretrained(
    model: Transformer, path: str | Path, tokenizer: Any = None, is_writer: bool = True, *,
    base: str | None = None, base_folder: str | Path | None = None,
) -> str | None:  # fmt: skip
    """Write `model` as a Hugging Face folder, whatever its layout (plain, compiled, checkpointed, sharded); a
    model with a LoRA adapter as the PEFT adapter directory its save_pretrained writes. With `base_folder`, the
    adapter names a base PEFT loads in one call, as `astrai-pl convert` does (`checkpoint.lora_base.peft_base`):
    `base` (the run's init_from) where that is a Hugging Face directory or a Hub id, else the base written into
    `base_folder`. Returns the base it named (None: no adapter, or not the writer), which a later export of the
    same run passes as `base` so that the frozen base is not written again."""
    state = full_state_dict(model)
    if not is_writer:
        return None
    plain = Transformer(model.config)
    adapted = getattr(model, "lora_config", None) is not None
    if adapted:
        apply_lora(plain, model.lora_config)
        originals = getattr(model, "lora_originals", {})  # modules_to_save as the base had them
        plain.__dict__["lora_originals"] = {k: v.detach().cpu() for k, v in originals.items()}
    plain.load_state_dict(state)
    named = None
    if adapted and base_folder is not None:
        plain.__dict__["adapter_extra"] = {"base_model_name_or_path": base}
        named = peft_base(plain, Path(base_folder), tokenizer, overwrite=True)
    plain.save_pretrained(path, tokenizer=tokenizer, overwrite=True)  # the callback's own step-N and final
    return named


class HFExport(L.Callback):
    """Export `dirpath/step-00001000` every `every_n_train_steps` optimizer steps, and `dirpath/final`
    when training ends. A LoRA run's exports are PEFT adapter directories whose adapter_config.json names
    their base, as `astrai-pl convert` writes them: init_from where it is a Hugging Face directory or a Hub
    id, else the base itself, written into `dirpath/base` (shared by the exports; a `.ckpt` init_from, or none).

    Args:
        dirpath: Folder that receives the exports; None: `hf/` in the run's directory (the trainer's log_dir,
            `default_root_dir/version_N` under astrai-pl fit).
        every_n_train_steps: Interval in optimizer steps; None exports only at the end.
        keep_last: How many `step-*` exports to keep (older ones are deleted); None keeps all.
        at_end: Export `final` when fit ends (also after a clean stop on SIGTERM).
    """

    def __init__(
        self,
        dirpath: str | None = None,
        every_n_train_steps: int | None = None,
        keep_last: int | None = None,
        at_end: bool = True,
    ):
        for name, value in (("every_n_train_steps", every_n_train_steps), ("keep_last", keep_last)):
            if value is not None and value < 1:
                raise ValueError(f"HFExport.{name}={value}: must be >= 1, or None")
        self.dirpath, self.every, self.keep_last, self.at_end = (
            None if dirpath is None else Path(dirpath),
            every_n_train_steps,
            keep_last,
            at_end,
        )
        self._step_seen = -1
        self._base: str | None = None  # the base this run's first adapter export named (a LoRA base is frozen)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._step_seen = trainer.global_step  # exports happen when an optimizer step completes

    def export(self, trainer: L.Trainer, pl_module: L.LightningModule, name: str) -> Path:
        if self.dirpath is None:
            self.dirpath = Path(trainer.log_dir or trainer.default_root_dir) / "hf"
        path = self.dirpath / name
        record = getattr(pl_module, "base_record", None) or {}  # a LoRA run's base: its init_from
        self._base = export_pretrained(pl_module.model, path, getattr(pl_module, "tokenizer", None),
                                       trainer.is_global_zero, base=self._base or record.get("init_from"),
                                       base_folder=self.dirpath / "base") or self._base
        trainer.strategy.barrier("hf_export")
        return path

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        step = trainer.global_step
        if self.every is None or step == self._step_seen or step % self.every:
            return
        self._step_seen = step
        self.export(trainer, pl_module, f"step-{step:08d}")
        if trainer.is_global_zero and self.keep_last is not None:
            for old in sorted(self.dirpath.glob("step-*"))[: -self.keep_last]:
                shutil.rmtree(old)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.at_end:
            self.export(trainer, pl_module, "final")
