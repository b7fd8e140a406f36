"""Attention over the paged KV pool: the per-step view every attention layer calls, and the backends behind it.

    view.py           StepView (the model's `cache=` for one step) and the AttentionBackend protocol
    torch_backend.py  `torch`: gather + scaled_dot_product_attention, and the CPU kernels on float32 CPU
    cpu_decode.py     a whole decode step of a Llama-shaped model on CPU in one kernel call
    cuda_backend.py   `cuda`: the fused decode kernel and a library prefill (SDPA, FlexAttention, flash-attn)
    flash_backend.py  `flash`: flash-attn's varlen kernel over gathered K/V
    backends.py       which backend a step runs (priority, overrides, what a model needs)

The kernels themselves, and the prefill/decode library choices they read (`ASTRAI_PREFILL`, `ASTRAI_DECODE`), live
in `astrai_pl.ops`, below this package.
"""

from .backends import (
    BACKEND_NAMES,
    BACKENDS,
    BackendUnavailable,
    attn_backend,
    available_backends,
    model_features,
    select_backend,
)
from .view import FEATURES, AttentionBackend, StepView

__all__ = [
    "BACKEND_NAMES",
    "BACKENDS",
    "FEATURES",
    "AttentionBackend",
    "BackendUnavailable",
    "StepView",
    "attn_backend",
    "available_backends",
    "model_features",
    "select_backend",
]
