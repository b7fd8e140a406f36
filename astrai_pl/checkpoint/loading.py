"""Loading a Transformer: a fresh one from its config, or the weights of a Hugging Face directory, a `.ckpt`
file or a sharded checkpoint folder, checked against the model they are loaded into."""

from __future__ import annotations

import contextvars
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..hub import resolve_model
from ..model import LoraConfig, ModelConfig, Transformer
from ..model.config import ConfigError
from ..model.hf import CheckpointError, NonFiniteWeightError, export_dir, nonfinite_tensors, read_config
from ..model.lora import apply_lora, merge_lora
from ..model.nf4 import quantize_base
from .archive import interrupted_copy, is_sharded_checkpoint, read_checkpoint
from .lora_base import candidates, note_found, search_roots
from .runs import resolve_latest


def as_config(arch: ModelConfig | dict | None) -> ModelConfig:
    """ModelConfig from itself, from its dict form (as stored in checkpoints), or the debug preset for a fresh
    model (a checkpoint without one is refused by `checkpoint_arch`)."""
    if arch is None:
        return ModelConfig.from_name("debug")
    return arch if isinstance(arch, ModelConfig) else ModelConfig(**arch)


def load_transformer(arch: ModelConfig | dict | None, init_from: str | None, quantize: str | None = None
                     ) -> Transformer:
    """A fresh Transformer(arch), or the weights in `init_from`: a Hugging Face directory or one of our .ckpt
    files. Weights holding NaN or ±inf are refused (NonFiniteWeightError naming the file and the tensor).

    `quantize="nf4"`: the linear weights come back in NF4 (QLoRA's base, model/nf4.py), read straight into it from
    a Hugging Face directory, quantised once loaded otherwise; except a LoRA run's checkpoint, which comes back
    with its adapter over its base as that run trained it, for the caller to merge before quantising."""
    if init_from is None:
        return _quantized(Transformer(as_config(arch)), quantize)
    init_from = resolve_model(init_from)  # a hub id (owner/name[@revision]): its snapshot in the hub cache
    init_from = resolve_latest(init_from)  # runs/x/latest/…: a pointer file names its run directory
    path, folder = Path(init_from), export_dir(init_from)  # or the complete export a cut-off replace left
    if folder.is_dir() and not is_sharded_checkpoint(folder):
        return Transformer.from_pretrained(folder, quantize=quantize)
    if not path.exists() and interrupted_copy(path) is None:
        raise CheckpointError(f"init_from={init_from!r}: no such file or directory; "
                              "pass a Hugging Face model directory or a .ckpt written by astrai-pl fit")
    ckpt = read_checkpoint(path)  # verified, weights_only; a sharded FSDP2 folder is gathered here
    state = {k.removeprefix("model."): v for k, v in ckpt.get("state_dict", {}).items() if k.startswith("model.")}
    adapter_only = "lora_base" in ckpt  # a LoRA run from init_from: its base is read from there
    if adapter_only:
        model = adapted_base(path, ckpt, arch)
    else:
        model = Transformer(checkpoint_arch(path, ckpt, arch))
        if (ckpt.get("hyper_parameters") or {}).get("quantize") == "nf4":  # a QLoRA run on a fresh base
            quantize_base(model)  # its state dict holds the NF4 base's inner tensors
        lora = (ckpt.get("hyper_parameters") or {}).get("lora")
        if isinstance(lora, dict):  # a LoRA run on a fresh model: the checkpoint holds base and adapter
            add_stored_adapter(path, model, lora)
    check_weights_fit(path, model, state, base_frozen=adapter_only)
    bad = nonfinite_tensors((f"model.{k}", v) for k, v in state.items())
    if bad:
        raise NonFiniteWeightError(
            f"{path}: weight(s) {', '.join(bad[:3])}{' and more' if len(bad) > 3 else ''} hold NaN or infinite "
            "values. Fix: the file is damaged or was saved after training diverged; use an earlier checkpoint.")
    model.load_state_dict(state, strict=not adapter_only)
    return model if model.lora_config is not None else _quantized(model, quantize)


def meta_transformer(arch: ModelConfig | dict | None, init_from: str | None) -> tuple[Transformer, Path | None]:
    """The Transformer that `load_transformer` gives, built on the meta device (shapes, no storage), and the Hugging
    Face directory to fill it from (None: a fresh model, to initialise). Only a Hugging Face directory can be read
    into shards; a .ckpt file or folder is refused with the way to convert it."""
    if init_from is None:
        with torch.device("meta"):
            return Transformer(as_config(arch)), None
    init_from = resolve_latest(resolve_model(init_from))  # as load_transformer: a hub id, then runs/x/latest/…
    folder = export_dir(init_from)
    if not folder.is_dir() or is_sharded_checkpoint(folder):
        raise CheckpointError(
            f"init_from={init_from!r}: a model built on the meta device is read into its shards from a Hugging Face "
            "directory, and this is an astrai-pl checkpoint. Fix: export it first (astrai-pl convert --ckpt CKPT --output DIR) "
            "and point init_from there, or set meta_init: false")
    with torch.device("meta"):
        return Transformer(read_config(folder)), folder


def recorded_tokenizer(ckpt: str | Path) -> str | None:
    """The tokenizer a run trained with, as its data module recorded it (datamodule_hyper_parameters.tokenizer):
    'byte' or a tokenizer directory; None for a Hugging Face directory or a checkpoint that records none."""
    path = Path(resolve_latest(str(ckpt)))
    if path.is_dir() and not is_sharded_checkpoint(path):
        return None
    if path.is_file():  # the weights are mapped, not read: only the metadata is looked at
        stored = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    else:
        stored = read_checkpoint(path)
    spec = (stored.get("datamodule_hyper_parameters") or {}).get("tokenizer")
    return spec if isinstance(spec, str) and spec else None


def _quantized(model: Transformer, quantize: str | None) -> Transformer:
    if quantize is None:
        return model
    if quantize != "nf4":
        raise ValueError(f"quantize={quantize!r}: the only quantisation is 'nf4' (QLoRA's base); pass it or None")
    return quantize_base(model)


def weights_fingerprint(model: nn.Module, samples: int = 65_536) -> float:
    """Σ_i (i + 1) · Σ |sample of tensor i|, in float64: a number that moves when the weights are others (an
    NF4 weight is sampled in its packed bytes)."""
    total = 0.0
    for i, p in enumerate(model.parameters()):
        flat = getattr(p, "quantized_data", p).detach().reshape(-1)
        total += (i + 1) * float(flat[:: max(1, flat.numel() // samples)].double().abs().sum())
    return total


def add_stored_adapter(path: Path, model: Transformer, lora: dict[str, Any]) -> None:
    """The adapter of a checkpoint's hyper_parameters.lora on `model`; CheckpointError naming the file and field."""
    try:
        apply_lora(model, LoraConfig(**lora))
    except (ConfigError, TypeError) as err:
        raise CheckpointError(f"{path}: hyper_parameters.lora: {err}") from None


_BASES_BEING_READ: contextvars.ContextVar[tuple[Path, ...]] = contextvars.ContextVar("lora_bases", default=())


def adapted_base(path: Path, ckpt: dict[str, Any], arch: ModelConfig | dict | None) -> Transformer:
    """The base of a LoRA run's checkpoint, read again from the init_from it records (or found by its fingerprint
    among its run's checkpoints, checkpoint/lora_base.py), with the run's adapter added (its weights still to
    load): the checkpoint itself holds only the adapter."""
    base = ckpt["lora_base"]
    hparams = ckpt.get("hyper_parameters") or {}
    if not isinstance(base, dict) or not base.get("init_from") or not isinstance(hparams.get("lora"), dict):
        raise CheckpointError(f"{path}: a LoRA checkpoint without the base it was trained on (lora_base.init_from) "
                              "or its adapter settings (hyper_parameters.lora). Fix: use a checkpoint that "
                              "astrai-pl fit wrote for a LoRA run.")
    model, used = _trained_base(path, base, hparams.get("quantize"), arch)
    if hparams.get("quantize") == "nf4":  # after the merge, as the run quantised it (a no-op when read as NF4)
        quantize_base(model)
    add_stored_adapter(path, model, hparams["lora"])
    model.__dict__["adapter_extra"] = {"base_model_name_or_path": used}  # for its PEFT export
    return model


def _read_base(path: Path, init_from: str, quantize: str | None, arch: ModelConfig | dict | None) -> Transformer:
    """The model in `init_from` as the LoRA checkpoint `path` trained on it (a LoRA base merged), refusing bases
    that lead back to a checkpoint being read."""
    chain, target = (*_BASES_BEING_READ.get(), path.resolve()), Path(init_from).resolve()
    if target in chain:  # LoRA checkpoints whose lora_base.init_from name each other: refused by path
        cycle = " -> ".join(map(str, (*chain[chain.index(target):], target)))
        raise CheckpointError(f"{path}: the lora_base.init_from of LoRA checkpoints lead in a circle ({cycle}), so "
                              "none has a base to read. Fix: point init_from at the model the adapter was trained on.")
    token = _BASES_BEING_READ.set(chain)
    try:  # a QLoRA run's base is read into NF4 again, as it was trained
        model = load_transformer(arch, init_from, quantize=quantize)
    except CheckpointError as err:
        raise CheckpointError(f"{path}: holds a LoRA adapter whose base is read from init_from="
                              f"{init_from!r}, which failed: {err}") from err
    finally:
        _BASES_BEING_READ.reset(token)
    if model.lora_config is not None:  # its base was itself a LoRA run's checkpoint: merged, as the run did
        merge_lora(model)
    return model


def _trained_base(path: Path, base: dict[str, Any], quantize: str | None, arch: ModelConfig | dict | None
                  ) -> tuple[Transformer, str]:
    """The base the adapter of `path` was trained on and where it was read: the recorded init_from, else (gone,
    or other weights there) the first checkpoint of its run root with the recorded fingerprint."""
    recorded, saved = str(base["init_from"]), base.get("fingerprint")
    try:
        model = _read_base(path, recorded, quantize, arch)
    except CheckpointError as err:
        if saved is None or "://" in recorded or Path(resolve_latest(recorded)).exists():
            raise  # not a moved base: what failed is named as it was
        why, failure = "is gone", err
    else:
        if saved is None or math.isclose(saved, weights_fingerprint(model), rel_tol=1e-9):
            return model, recorded
        why, failure = "holds other weights", None
    skip = (Path(recorded), path, *_BASES_BEING_READ.get())
    searched = 0
    for candidate in candidates(path, base, skip):
        searched += 1
        try:
            model = _read_base(path, str(candidate), quantize, arch)
        except CheckpointError:
            continue  # a damaged or unrelated checkpoint of the run: not the base
        if math.isclose(saved, weights_fingerprint(model), rel_tol=1e-9):
            note_found(path, recorded, candidate, why)
            return model, str(candidate)
    roots = ", ".join(map(str, search_roots(path, base))) or "no run folder found"
    detail = (f"{failure}" if failure is not None else f"{path}: the base weights at init_from={recorded!r} are "
              "not those the adapter was trained on (their fingerprint differs)")
    raise CheckpointError(f"{detail}; none of the {searched} other checkpoint(s) of its runs ({roots}) holds them. "
                          "Fix: restore that base model where init_from names it.") from None


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


def check_weights_fit(path: Path, model: nn.Module, state: dict[str, Any], base_frozen: bool = False) -> None:
    """CheckpointError naming the first weight of `state` that is missing, extra or shaped unlike `model`'s
    (`base_frozen`: a LoRA checkpoint, which holds only the adapter's weights)."""
    own = model.state_dict()
    if base_frozen:
        from ..model.lora import adapter_state

        own = {k: v for k, v in own.items() if k in adapter_state(model)}
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
