"""PEFT adapter directories: adapter_config.json + adapter_model.safetensors, written and read.

The directory is what `peft.PeftModel.save_pretrained` writes for a LoRA adapter and what
`PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), dir)` reads. Tensor names are PEFT's:
`base_model.model.` + the Hugging Face name of the module + `.lora_A.weight` / `.lora_B.weight`, and
`base_model.model.` + the Hugging Face name of each parameter of a module_to_save.

Reading checks before it loads anything: the JSON is an object, the adapter is LoRA, every PEFT option that would
change what the adapter computes is one this model implements (others are refused, by name, rather than
silently ignored), every tensor has a place in the model and the right shape, none is NaN/inf. Writing is
atomic, as model exports are: the folder is written beside its target and moved into place.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from ..atomic import partial_path, remove_path, replace_path
from .config import ConfigError, ModelConfig
from .export_manifest import check_overwrite, write_manifest
from .hf import _carry_over, _check_finite, _open, _read_json, save_tokenizer
from .hf_config import CheckpointError, CheckpointNotFoundError, ExportError, NonFiniteWeightError
from .hf_keys import hf_name
from .lora import LoraConfig, adapter_state, apply_lora, hf_module_name, lora_modules
from .trainable_tokens import EMBEDDING, ROWS_KEY

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."

# PEFT options that change what an adapter computes, with the value under which they change nothing.
_NEUTRAL = {"use_dora": False, "lora_bias": False, "fan_in_fan_out": False, "layers_to_transform": None,
            "layer_replication": None, "rank_pattern": {}, "alpha_pattern": {},
            "target_parameters": None, "exclude_modules": None, "use_qalora": False, "alora_invocation_tokens": None}
_OURS = ("r", "lora_alpha", "lora_dropout", "target_modules", "use_rslora", "modules_to_save", "bias",
         "trainable_token_indices")
TOKEN_ROWS = "token_adapter.trainable_tokens_delta"  # PEFT's name of the trainable tokens' rows


def is_adapter_dir(path: str | Path) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def _peft_key(key: str, model_type: str) -> str:
    """PEFT's tensor name for our state-dict `key` (a lora_A/lora_B weight or a module_to_save parameter)."""
    for part in (".lora_A.", ".lora_B."):
        if part in key:
            module, _, rest = key.partition(part)
            return f"{PEFT_PREFIX}{hf_module_name(module, model_type)}{part}{rest}"
    if key == ROWS_KEY:
        return f"{PEFT_PREFIX}{hf_module_name(EMBEDDING, model_type)}.{TOKEN_ROWS}"
    return PEFT_PREFIX + hf_name(key, model_type)


def fused_targets(model: nn.Module) -> list[str]:
    """The adapted modules that the Hugging Face layout fuses with others (Phi-3's qkv_proj and gate_up_proj),
    where a PEFT adapter has one A and B for the fused matrix: none of ours maps onto it."""
    mt = model.config.model_type
    return [n for n, _ in lora_modules(model) if not hf_module_name(n, mt).endswith("." + n.rsplit(".", 1)[-1])]


def _fused_advice(model: nn.Module) -> str:
    mt, name = model.config.model_type, fused_targets(model)[0]
    return f"{mt} holds {name} fused with others ({hf_module_name(name, mt)}) in its Hugging Face layout"


def adapter_config_json(model: nn.Module, base_model_name_or_path: str | None = None) -> dict[str, Any]:
    """adapter_config.json for `model`'s adapter; target_modules spelled out as the full Hugging Face module
    names (as PEFT writes them for all-linear), so PEFT adapts exactly the modules adapted here."""
    lora: LoraConfig = model.lora_config
    cfg: ModelConfig = model.config
    extra = model.__dict__.get("adapter_extra", {})  # what the PEFT file it was read from said besides
    return {
        **extra,
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "inference_mode": True,
        "base_model_name_or_path": base_model_name_or_path or extra.get("base_model_name_or_path"),
        "r": lora.r, "lora_alpha": lora.lora_alpha, "lora_dropout": lora.lora_dropout,
        "target_modules": sorted(hf_module_name(n, cfg.model_type) for n, _ in lora_modules(model)),
        "use_rslora": lora.use_rslora, "modules_to_save": lora.modules_to_save, "bias": lora.bias,
        "init_lora_weights": True, **_NEUTRAL, "trainable_token_indices": lora.trainable_token_indices,
    }


def save_adapter(model: nn.Module, path: str | Path, tokenizer: Any = None,
                 base_model_name_or_path: str | None = None, overwrite: bool = False) -> None:
    """Write `model`'s adapter as a PEFT directory (and the tokenizer's files, when given, as a model export
    writes them: its chat template led by the BOS, `hf.save_tokenizer`). Into an existing folder as
    `hf.save_pretrained` does: other files kept, one no export wrote overwritten only with `overwrite`."""
    from .hf import nonfinite_tensors

    target = Path(path)
    if target.exists() and not target.is_dir():
        raise FileExistsError(f"{target} exists and is not a directory. Fix: pass a directory path.")
    if fused_targets(model):
        raise ExportError(f"{target}: not written, because {_fused_advice(model)}, which a PEFT adapter cannot "
                          "split. Fix: merge the adapter (merge_lora, or astrai-pl convert --merge-lora) and save "
                          "the full model, or adapt only o_proj and down_proj.")
    state = {_peft_key(k, model.config.model_type): v.detach().to("cpu").contiguous()
             for k, v in adapter_state(model).items()}
    bad = nonfinite_tensors(state.items())
    if bad:
        raise NonFiniteWeightError(f"{target}: not written, because adapter weight(s) {', '.join(bad[:3])} hold "
                                   "NaN or infinite values. Fix: save a checkpoint from before training diverged.")
    target.parent.mkdir(parents=True, exist_ok=True)
    work = partial_path(target)
    remove_path(work)
    work.mkdir()
    try:
        if tokenizer is not None:
            save_tokenizer(tokenizer, work)
        writes = {p.name for p in work.iterdir()} | {ADAPTER_WEIGHTS, ADAPTER_CONFIG}
        left_out = check_overwrite(target, writes, overwrite)
        save_file(state, str(work / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        if target.is_dir():
            _carry_over(target, work, left_out | writes)
        config = adapter_config_json(model, base_model_name_or_path)
        (work / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        write_manifest(work, writes)
        replace_path(work, target)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise


def read_adapter_config(path: str | Path) -> tuple[LoraConfig, dict[str, Any]]:
    """The LoraConfig of a PEFT adapter directory and its other fields; CheckpointError naming the file and the
    field when the adapter is not one this model can compute exactly."""
    file = Path(path) / ADAPTER_CONFIG
    if not Path(path).is_dir():
        raise CheckpointNotFoundError(f"adapter {path}: not a directory. Fix: pass the folder that holds "
                                      f"{ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}.")
    raw = _read_json(file)
    if raw.get("peft_type", "LORA") != "LORA":
        raise CheckpointError(f"{file}: peft_type={raw.get('peft_type')!r}; only LoRA adapters (peft_type LORA) "
                              "are supported. Fix: train a LoRA adapter, or merge this one with PEFT first.")
    if raw.get("target_parameters"):
        raise CheckpointError(f"{file}: target_parameters={raw['target_parameters']!r}: this adapter adapts "
                              "parameters that are not linear layers (PEFT does so for the fused experts of MoE "
                              "models), which is not supported here. Fix: train the adapter with target_modules "
                              "naming linear layers (e.g. the attention projections), or merge it with PEFT's "
                              "merge_and_unload and load the merged model.")
    for name, neutral in _NEUTRAL.items():
        value = raw.get(name, neutral)
        if value != neutral and not (neutral in ({}, None) and not value):
            raise CheckpointError(f"{file}: {name}={value!r} is not supported (it changes what the adapter "
                                  f"computes). Fix: use an adapter with {name}={neutral!r}, or merge it with "
                                  "PEFT's merge_and_unload and load the merged model.")
    try:
        lora = LoraConfig(**{k: raw[k] for k in _OURS if k in raw})
    except Exception as err:  # ConfigError names the field; say which file it came from
        raise CheckpointError(f"{file}: {err}") from None
    return lora, {k: v for k, v in raw.items() if k not in _OURS and k not in _NEUTRAL}


def load_adapter(model: nn.Module, path: str | Path) -> nn.Module:
    """Add the adapter in PEFT directory `path` to `model` (in place) with its weights; returns `model`."""
    state = read_adapter_tensors(model, attach_adapter(model, path))
    own = adapter_state(model)
    with torch.no_grad():
        for key, tensor in state.items():
            own[key].copy_(tensor)
    return model


def attach_adapter(model: nn.Module, path: str | Path) -> Path:
    """Give `model` (in place) the adapter layers that PEFT directory `path` describes, weights not read yet;
    the path of its weights file. CheckpointError naming the file for an adapter this model cannot compute."""
    lora, extra = read_adapter_config(path)
    file = Path(path) / ADAPTER_WEIGHTS
    if not file.is_file():
        raise CheckpointNotFoundError(f"{file} does not exist. Fix: pass a PEFT adapter directory (it holds "
                                      f"{ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}; .bin adapters are not read).")
    try:
        apply_lora(model, lora)
    except ConfigError as err:  # it names the field (r, target_modules); say which file it came from
        raise CheckpointError(f"{Path(path) / ADAPTER_CONFIG}: {err}") from None
    if fused_targets(model):
        raise CheckpointError(f"{Path(path) / ADAPTER_CONFIG}: target_modules adapt fused layers: "
                              f"{_fused_advice(model)}, and the adapter's matrices would have to be split. Fix: "
                              "merge it with PEFT's merge_and_unload and load the merged model.")
    model.__dict__["adapter_extra"] = extra
    return file


def read_adapter_tensors(model: nn.Module, file: Path) -> dict[str, torch.Tensor]:
    """The tensors of adapter weights `file`, under `model`'s state-dict keys, once each is checked against the
    adapter `model` holds (apply_lora): a place for every tensor, the right shape, finite values, none missing.
    `model` may live on the meta device (only names and shapes are read from it)."""
    own = adapter_state(model)
    by_peft = {_peft_key(k, model.config.model_type): k for k in own}
    state: dict[str, torch.Tensor] = {}
    with _open(file) as f:
        keys = list(f.keys())
        extra = [k for k in keys if _strip_adapter_name(k) not in by_peft]
        if extra:
            raise CheckpointError(f"{file}: {len(extra)} tensor(s) have no place in this model's adapter "
                                  f"({extra[0]!r}, …). Fix: load the adapter on the base it was trained on.")
        for key in keys:
            ours = by_peft[_strip_adapter_name(key)]
            shape = tuple(f.get_slice(key).get_shape())
            if shape != tuple(own[ours].shape):
                raise CheckpointError(f"{file}: {key!r} is {shape}, the model needs {tuple(own[ours].shape)}. "
                                      "Fix: load the adapter on the base it was trained on (same sizes).")
            tensor = f.get_tensor(key)
            _check_finite(file, key, tensor)
            state[ours] = tensor
    missing = sorted(set(own) - set(state))
    if missing:
        raise CheckpointError(f"{file}: {len(missing)} adapter tensor(s) are missing, e.g. "
                              f"{_peft_key(missing[0], model.config.model_type)!r}. Fix: re-save the adapter.")
    return state


def _strip_adapter_name(key: str) -> str:
    """PEFT's in-memory names carry the adapter name (`lora_A.default.weight`); saved files do not."""
    return key.replace(".default.", ".")
