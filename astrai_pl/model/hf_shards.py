"""A Hugging Face checkpoint read straight into parameters that already exist, each perhaps a DTensor (an FSDP2
shard, a tensor-parallel part): every process reads from the safetensors files only the region of each tensor
that it holds (safetensors' `get_slice`), so no process ever holds the whole model.

The checks are those of `load_pretrained` (hf.py): every key and shape against the model, from the headers alone,
before a tensor is read; a region holding NaN or ±inf, as stored or once cast, is refused naming the file and the
tensor. A tensor that the file holds in another layout (a fused expert or Phi-3 projection, RWKV's (1, 1, H) μ)
is read as one expert or one block of rows where it can be, else whole, one tensor at a time.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import torch
from torch import nn

from .hf import _check_finite, _open, export_dir, plan_weights, read_config, weight_files
from .hf_keys import Source
from .layers import RotaryEmbedding, rope_frequencies


def _is_dtensor(tensor: torch.Tensor) -> bool:
    return type(tensor).__name__ == "DTensor"


def local_region(param: torch.Tensor) -> tuple[slice, ...]:
    """The region of the whole tensor that this process holds of `param`: all of it for a plain tensor, the local
    shard's rows (and columns) for a DTensor."""
    if not _is_dtensor(param):
        return tuple(slice(0, n) for n in param.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return tuple(slice(start, start + n) for start, n in zip(offset, shape))


def local_part(param: torch.Tensor) -> torch.Tensor:
    """What this process stores of `param` (the local shard of a DTensor), to be written in place."""
    return param.to_local() if _is_dtensor(param) else param


def read_region(f, source: Source, region: tuple[slice, ...]) -> torch.Tensor:
    """`region` of the tensor `source` describes, from the open safetensors file `f`."""
    stored = f.get_slice(source.key)
    if source.expert is None and tuple(stored.get_shape()) == source.shape:
        return stored[region] if region else stored[:]  # only these rows and columns are read
    if source.expert is None and source.rows is not None:  # Phi-3: our rows are a block of the fused tensor's
        first = region[0]
        return stored[(slice(source.rows[0] + first.start, source.rows[0] + first.stop), *region[1:])]
    if source.expert is not None:  # one expert's matrix of a fused (E, …) tensor
        whole = stored[source.expert:source.expert + 1][0]
        whole = whole if source.rows is None else whole[source.rows[0]:source.rows[1]]
        return whole[region]
    return source.take(stored[:])[region]  # RWKV's μ: read whole (a vector), then taken


def restore_rotary_buffers(model: nn.Module) -> None:
    """Recompute the RoPE tables, which no checkpoint holds (non-persistent buffers), on their module's device."""
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            device = module.inv_freq.device if module.inv_freq.device.type != "meta" else None
            inv_freq = rope_frequencies(module.cfg)[0]
            module.register_buffer("inv_freq", inv_freq if device is None else inv_freq.to(device), persistent=False)


def load_pretrained_into(model: nn.Module, path: str | Path) -> None:
    """Fill `model`'s parameters (plain or DTensor, already on their device; a tied output layer shares the
    embedding) with the weights of the Hugging Face directory `path`, each process reading only its regions,
    cast to each parameter's dtype. Every key and shape is checked against the model's before a tensor is read."""
    root = export_dir(path)
    params = dict(model.named_parameters())  # a tied lm_head.weight is named once, as embed_tokens.weight
    sources = plan_weights(weight_files(root), read_config(root), {k: tuple(p.shape) for k, p in params.items()})
    by_file: dict[Path, list[tuple[str, Source]]] = defaultdict(list)
    for key, source in sources.items():
        by_file[source.file].append((key, source))
    with torch.no_grad():
        for file, items in by_file.items():
            with _open(file) as f:
                for key, source in items:
                    param = params[key]
                    region = read_region(f, source, local_region(param))
                    _check_finite(file, source.key, region)
                    cast = region.to(param.dtype)
                    if cast.dtype != region.dtype:
                        _check_finite(file, source.key, cast, cast=True)
                    local_part(param).copy_(cast)
    restore_rotary_buffers(model)
