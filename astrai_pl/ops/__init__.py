"""Fused CUDA kernels for inference and their PyTorch references.

    rotary_emb       rotary position embedding on q and k, in place (the model's rotate-half layout)
    paged_decode     one query per request against the paged K/V pool (split-KV for long contexts)
    paged_prefill    a ragged batch of causal queries against the paged K/V pool (library kernels on CUDA:
                     SDPA, FlexAttention or flash-attn, see `prefill`)
    paged_attention  the engine's entry point: decode or prefill, whichever fits the step
    store_kv         write a step's new K/V rows into the pool in one kernel

Each op runs its kernel on CUDA tensors when `available()`; anywhere else it runs the reference of the
same name with `_ref` appended (also exported), logging the first fallback once. The sources are in the
repository's `cuda/` folder; `load()` builds them on first use. `python -m astrai_pl.ops.check`
compiles them without a GPU. Every argument is checked before a launch (`arguments`): a bad one raises
`KernelArgumentError` (a RuntimeError) naming it; `check_indices()` adds range checks of the page table.
"""

from .arguments import KernelArgumentError, check_indices
from .build import KernelsUnavailable, available, load, override_available, unavailable_reason
from .fused import decode_splits, paged_attention, paged_decode, paged_prefill, rotary_emb, store_kv
from .reference import (
    paged_attention_ref,
    paged_decode_ref,
    paged_prefill_ref,
    rotary_emb_ref,
    store_kv_ref,
)

__all__ = [
    "KernelArgumentError",
    "KernelsUnavailable",
    "check_indices",
    "available",
    "decode_splits",
    "load",
    "override_available",
    "paged_attention",
    "paged_attention_ref",
    "paged_decode",
    "paged_decode_ref",
    "paged_prefill",
    "paged_prefill_ref",
    "rotary_emb",
    "rotary_emb_ref",
    "store_kv",
    "store_kv_ref",
    "unavailable_reason",
]
