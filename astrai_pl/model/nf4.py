"""QLoRA's frozen base (Dettmers et al., 2023, "QLoRA: Efficient Finetuning of Quantized LLMs"): each linear weight
stored in 4-bit NormalFloat (NF4) with double quantisation, dequantised inside every matmul.

A weight W is cut into blocks of 64 values; each block is divided by its absmax and every value becomes the index
(4 bits) of the nearest of the 16 NF4 levels, quantiles of N(0, 1) scaled to [-1, 1]. The blocks' absmaxes are
themselves quantised ("double quantisation"): their mean is subtracted and they are stored as int8 in groups of
up to 256 with one float scale per group. About 0.52 bytes a weight instead of bf16's 2.

The tensor is torchao's `NF4Tensor` (the one torchtune's QLoRA uses): a PyTorch tensor subclass, so
`F.linear(x, weight)` dequantises it and back-propagates to `x` on CPU and CUDA alike, under autocast too. A
weight kept as an `NF4Tensor` parameter is frozen; the adapters beside it (lora.py) train in float32.

Which weights: every linear layer's, except the output layer (`lm_head`), as bitsandbytes' 4-bit loading does;
embeddings and norms stay as they are. torchao needs the number of values to be a multiple of the block (64) and
the number of blocks to be a multiple of the group: the group is 256 (QLoRA's) where that divides the blocks,
else the largest divisor of the block count below it. A weight that cannot be blocked so (or whose blocks'
scales are not finite, e.g. an all-zero weight) keeps its dtype, with one log line.

In a state dict an NF4 weight `K` is written as its inner tensors, `K.quantized_data`, `K.quantized_scalers`, …
(plain tensors, so checkpoints load with weights_only=True), and read back from them exactly: a run on a fresh,
quantised base resumes on the very same 4-bit weights.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
from torch import nn

from .config import ConfigError
from .hf_config import CheckpointError
from .layers import Linear

BLOCK_SIZE = 64  # values per absmax block (QLoRA)
SCALER_GROUP = 256  # block absmaxes per double-quantisation group (QLoRA), at most
QUANTIZE_CHOICES = ("nf4",)
_FIELD = "model.init_args.quantize"
_HOOKED = "_nf4_state_dict_hooks"
log = logging.getLogger(__name__)


@functools.cache
def _torchao() -> Any:
    """torchao's NF4 module, imported on first use; its import-time notices (compiled extensions this build of
    torch cannot load, which NF4 does not use; a pytree deprecation) are silenced, its later warnings are not."""
    noisy = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in noisy]
    try:
        for logger in noisy:
            logger.setLevel(logging.ERROR)
        from torchao.quantization import NF4Tensor, to_nf4
    except ImportError as err:
        raise ConfigError(f"{_FIELD}=nf4 needs torchao (pip install 'torchao>=0.18'): {err}") from None
    finally:
        for logger, level in zip(noisy, levels):
            logger.setLevel(level)
    return NF4Tensor, to_nf4


def check_quantize(quantize: str | None, lora: Any) -> None:
    """ConfigError unless `quantize` is None, or "nf4" with a LoRA adapter to train (a 4-bit base cannot train)."""
    if quantize is None:
        return
    if quantize not in QUANTIZE_CHOICES:
        raise ConfigError(f"{_FIELD}={quantize!r}: the only quantisation is nf4 (QLoRA); set it to nf4 or null")
    if lora is None:
        raise ConfigError(f"{_FIELD}={quantize!r} quantises the frozen base of a LoRA adapter (QLoRA), but no "
                          "adapter is configured: add a model.init_args.lora block, or set quantize: null")


def is_nf4(weight: Any) -> bool:
    return type(weight).__name__ == "NF4Tensor" and hasattr(weight, "get_original_weight")


def scaler_group(numel: int) -> int | None:
    """The double-quantisation group for a weight of `numel` values, or None when it cannot be blocked."""
    if numel == 0 or numel % BLOCK_SIZE:
        return None
    blocks = numel // BLOCK_SIZE
    return next(g for g in range(min(SCALER_GROUP, blocks), 0, -1) if blocks % g == 0)


def to_nf4(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` (2-d) in NF4 with double quantisation, or None when it cannot be blocked (see the module doc)."""
    group = scaler_group(weight.numel())
    if group is None or weight.dim() != 2 or not weight.is_floating_point():
        return None
    _, quantize = _torchao()
    nf4 = quantize(weight.detach().contiguous(), BLOCK_SIZE, group)
    return nf4 if bool(torch.isfinite(nf4.quantization_factor).all()) else None


def quantized_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The linear layers whose weights QLoRA stores in NF4: all but the output layer (and never an adapter's own
    lora_A / lora_B, which are plain nn.Linear)."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, Linear) and name != "lm_head"]


def quantize_on_load(key: str, tensor: torch.Tensor, owner: nn.Module) -> torch.Tensor:
    """The loader's per-tensor transform (hf.load_pretrained): a linear layer's weight, other than the output
    layer's, comes back in NF4 as soon as it is read; anything else, or a weight that cannot be blocked, as is."""
    if not (isinstance(owner, Linear) and key.endswith(".weight") and key != "lm_head.weight"):
        return tensor
    return to_nf4(tensor) if not is_nf4(tensor) else tensor


def quantize_base(model: nn.Module) -> nn.Module:
    """Store every linear weight of `model` but the output layer's in NF4, frozen, in place (weights already in NF4
    are kept); returns `model`. Weights that cannot be blocked keep their dtype: one log line names them."""
    kept = []
    for name, module in quantized_linears(model):
        weight = module.weight
        nf4 = weight if is_nf4(weight) else to_nf4(weight)
        if nf4 is None:
            kept.append(f"{name}.weight {tuple(weight.shape)}")
            continue
        module.weight = nn.Parameter(nf4, requires_grad=False)
    if kept:
        log.warning("NF4: %d linear weight(s) stay in their dtype (not whole %d-value blocks, or block scales that "
                    "are not finite): %s", len(kept), BLOCK_SIZE, ", ".join(kept[:4]) + (" …" if len(kept) > 4 else ""))
    if not getattr(model, _HOOKED, False):
        model.register_state_dict_post_hook(_write_inner_tensors)
        model.register_load_state_dict_pre_hook(_read_inner_tensors)
        model.__dict__[_HOOKED] = True
    return model


def nf4_bytes(weight: torch.Tensor) -> int:
    """Bytes an NF4 weight holds: the sum over its inner tensors (codes, int8 scales, group scales, levels)."""
    names, _ = weight.__tensor_flatten__()
    return sum(getattr(weight, n).numel() * getattr(weight, n).element_size() for n in names)


# -- state dicts: an NF4 weight as its plain inner tensors ------------------------------------------------
def _write_inner_tensors(module: nn.Module, state: dict[str, Any], prefix: str, metadata: Any) -> None:
    for key in [k for k, v in state.items() if k.startswith(prefix) and is_nf4(v)]:
        weight = state.pop(key)
        names, _ = weight.__tensor_flatten__()
        state.update({f"{key}.{name}": getattr(weight, name) for name in names})


def _read_inner_tensors(module: nn.Module, state: dict[str, Any], prefix: str, *args: Any) -> None:
    """Rebuild each NF4 weight of `module` found in `state` as its inner tensors; loading then copies it exactly."""
    for name, param in module.named_parameters():
        if not is_nf4(param):
            continue
        key = prefix + name
        names, context = param.__tensor_flatten__()
        parts = {n: state.get(f"{key}.{n}") for n in names}
        if not all(isinstance(t, torch.Tensor) for t in parts.values()):
            continue  # absent here (an adapter-only checkpoint), or a plain weight, which loading quantises
        wrong = [n for n in names if parts[n].shape != getattr(param, n).shape]
        if wrong:
            raise CheckpointError(f"{key}.{wrong[0]} is {tuple(parts[wrong[0]].shape)} in the state dict but "
                                  f"{tuple(getattr(param, wrong[0]).shape)} in this NF4 model. Fix: load it into "
                                  "the architecture it was saved from")
        for n in names:
            del state[f"{key}.{n}"]
        NF4Tensor, _ = _torchao()
        state[key] = NF4Tensor.__tensor_unflatten__(parts, context, param.shape, param.stride())
