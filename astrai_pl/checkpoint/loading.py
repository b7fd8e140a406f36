"""Loading a Transformer: a fresh one from its config, or the weights of a Hugging Face directory, a `.ckpt`
file or a sharded checkpoint folder, checked against the model they are loaded into."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..model import ModelConfig, Transformer
from ..model.hf import CheckpointError, NonFiniteWeightError, export_dir, nonfinite_tensors
from .archive import interrupted_copy, is_sharded_checkpoint, read_checkpoint


def as_config(arch: ModelConfig | dict | None) -> ModelConfig:
    """ModelConfig from itself, from its dict form (as stored in checkpoints), or the debug preset for a fresh
    model (a checkpoint without one is refused by `checkpoint_arch`)."""
    if arch is None:
        return ModelConfig.from_name("debug")
    return arch if isinstance(arch, ModelConfig) else ModelConfig(**arch)


def load_transformer(arch: ModelConfig | dict | None, init_from: str | None) -> Transformer:
    """A fresh Transformer(arch), or the weights in `init_from`: a Hugging Face directory or one of our .ckpt
    files. Weights holding NaN or ±inf are refused (NonFiniteWeightError naming the file and the tensor)."""
    if init_from is None:
        return Transformer(as_config(arch))
    path, folder = Path(init_from), export_dir(init_from)  # or the complete export a cut-off replace left
    if folder.is_dir() and not is_sharded_checkpoint(folder):
        return Transformer.from_pretrained(folder)
    if not path.exists() and interrupted_copy(path) is None:
        raise CheckpointError(f"init_from={init_from!r}: no such file or directory; "
                              "pass a Hugging Face model directory or a .ckpt written by astrai-pl fit")
    ckpt = read_checkpoint(path)  # verified, weights_only; a sharded FSDP2 folder is gathered here
    model = Transformer(checkpoint_arch(path, ckpt, arch))
    state = {k.removeprefix("model."): v for k, v in ckpt.get("state_dict", {}).items() if k.startswith("model.")}
    check_weights_fit(path, model, state)
    bad = nonfinite_tensors((f"model.{k}", v) for k, v in state.items())
    if bad:
        raise NonFiniteWeightError(
            f"{path}: weight(s) {', '.join(bad[:3])}{' and more' if len(bad) > 3 else ''} hold NaN or infinite "
            "values. Fix: the file is damaged or was saved after training diverged; use an earlier checkpoint.")
    model.load_state_dict(state)
    return model


def checkpoint_arch(path: Path, ckpt: dict[str, Any], arch: ModelConfig | dict | None) -> ModelConfig:
    """The model shape a checkpoint records in hyper_parameters.arch (else `arch`, when the caller gives one)."""
    hparams = ckpt.get("hyper_parameters")
    stored = hparams.get("arch") if isinstance(hparams, dict) else None
    if stored is None and arch is None:
        raise CheckpointError(
            f"{path}: records no hyper_parameters.arch, so the shape of its model is unknown. Fix: set "
            "model.init_args.arch to the architecture it was trained with, or add "
            "checkpoint['hyper_parameters']['arch'] = ModelConfig(...).to_dict() and save it again."
        )
    try:
        return as_config(stored if stored is not None else arch)
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"{path}: hyper_parameters.arch is not a model config ({err}). Fix: re-save it "
                              "with ModelConfig(...).to_dict(), or use another checkpoint.") from err


def check_weights_fit(path: Path, model: nn.Module, state: dict[str, Any]) -> None:
    """CheckpointError naming the first weight of `state` that is missing, extra or shaped unlike `model`'s."""
    own = model.state_dict()
    missing, extra = sorted(own.keys() - state.keys()), sorted(state.keys() - own.keys())
    wrong = [k for k in own.keys() & state.keys()
             if not isinstance(state[k], torch.Tensor) or state[k].shape != own[k].shape]
    if not (missing or extra or wrong):
        return
    if wrong:
        key = sorted(wrong)[0]
        got = tuple(state[key].shape) if isinstance(state[key], torch.Tensor) else type(state[key]).__name__
        first = f"model.{key} is {got} in the file but {tuple(own[key].shape)} in the model"
    else:
        first = f"model.{(missing or extra)[0]} is {'missing from the file' if missing else 'not in the model'}"
    counts = f"{len(wrong)} shape mismatches, {len(missing)} missing, {len(extra)} unexpected"
    raise CheckpointError(
        f"{path}: its weights do not fit the model its arch describes: {first} ({counts}). Fix: use "
        "the checkpoint with the architecture it was trained with, or re-save it from that model."
    )
