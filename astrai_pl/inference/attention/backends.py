"""Attention over the KV pool: the per-step view the model calls, three backends, and how one is chosen.

The model's attention layers call `view.attend(layer, q, k, v)` once per layer. The view writes the new
K/V at this step's slots and hands q to the backend chosen for the step:

- `cuda`: the fused paged-attention kernels of `astrai_pl.ops`, when they build for this device;
- `flash`: flash-attn's varlen kernel over K/V gathered through req_to_token (CUDA, fp16/bf16);
- `torch`: gather through req_to_token, then `scaled_dot_product_attention`; always available.

Priority is cuda > flash > torch. `ASTRAI_BACKEND=cuda|flash|torch` or `with attn_backend("torch"):`
override it; the context manager wins over the environment, nests, and is per thread and per task
(contextvars). Forcing a backend that cannot run here raises `BackendUnavailable`.

All tensors are (tokens, heads, head_dim) inside the view; a step's tokens are the requests' new tokens
concatenated, decodes (one token each) first. Scale is 1/sqrt(head_dim) unless the layer gives its own.

Sliding windows, soft-capped scores and a scale of the model's own (`model_features`) are done by every
backend: the `cuda` decode kernel takes them as arguments, and its prefill path (`astrai_pl.ops.prefill`)
passes them to the library kernel it runs, so Gemma 2/3 and Mistral-style models keep the fused kernels.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from contextvars import ContextVar

import torch

from ..cache import InferenceError
from .cuda_backend import CudaBackend
from .flash_backend import FlashBackend
from .torch_backend import TorchBackend
from .view import FEATURES, AttentionBackend

log = logging.getLogger(__name__)

BACKEND_NAMES = ("cuda", "flash", "torch")  # in priority order


class BackendUnavailable(InferenceError):
    """An attention backend was forced but cannot run on this device, dtype or installation."""


def model_features(cfg) -> tuple[str, ...]:
    """What a model's attention asks of a backend beyond plain causal attention at 1/sqrt(head_dim)."""
    needs = {
        "sliding_window": any(cfg.layer_window(i) is not None for i in range(cfg.num_hidden_layers)),
        "softcap": cfg.attn_logit_softcapping is not None,
        "scale": cfg.query_pre_attn_scalar is not None,
    }
    return tuple(name for name in FEATURES if needs[name])


# -- selection ------------------------------------------------------------------------------------------------
BACKENDS: dict[str, AttentionBackend] = {
    "cuda": CudaBackend(),
    "flash": FlashBackend(),
    "torch": TorchBackend(),
}
_forced: ContextVar[str | None] = ContextVar("astrai_attn_backend", default=None)
_logged: set[tuple[str, str]] = set()


def _checked(name: str, source: str) -> str:
    key = name.strip().lower()
    if key not in BACKENDS:
        raise ValueError(
            f"{source}={name!r} is not an attention backend; use one of {', '.join(BACKEND_NAMES)}"
        )
    return key


@contextlib.contextmanager
def attn_backend(name: str) -> Iterator[None]:
    """Use attention backend `name` ("cuda", "flash" or "torch") inside the block; nested blocks restore."""
    token = _forced.set(_checked(name, "attn_backend"))
    try:
        yield
    finally:
        _forced.reset(token)


def _why_not(name: str, device: torch.device, dtype: torch.dtype, needs: tuple[str, ...]) -> str | None:
    backend = BACKENDS[name]
    lacking = [f for f in needs if f not in getattr(backend, "features", FEATURES)]
    if lacking:
        return f"the model needs {', '.join(lacking)}, which the {name} backend does not do"
    return backend.unavailable_reason(device, dtype)


def available_backends(device: torch.device, dtype: torch.dtype, needs: tuple[str, ...] = ()) -> list[str]:
    return [n for n in BACKEND_NAMES if _why_not(n, torch.device(device), dtype, needs) is None]


def select_backend(device: torch.device, dtype: torch.dtype, needs: tuple[str, ...] = ()) -> AttentionBackend:
    """The forced backend (attn_backend() first, then ASTRAI_BACKEND) or the best available one that does
    what the model `needs` (`model_features`)."""
    device = torch.device(device)
    name, source = _forced.get(), "attn_backend"
    if name is None and os.environ.get("ASTRAI_BACKEND"):
        name, source = _checked(os.environ["ASTRAI_BACKEND"], "ASTRAI_BACKEND"), "ASTRAI_BACKEND"
    if name is not None:
        why = _why_not(name, device, dtype, needs)
        if why is not None:
            raise BackendUnavailable(
                f"attention backend {name!r} was forced by {source} but cannot run: {why}; "
                f"use one of {', '.join(available_backends(device, dtype, needs))} or drop the override"
            )
        return BACKENDS[name]
    skipped = []
    for candidate in BACKEND_NAMES:
        why = _why_not(candidate, device, dtype, needs)
        if why is None:
            if skipped and device.type == "cuda" and (candidate, device.type) not in _logged:
                _logged.add((candidate, device.type))
                log.info("attention backend %s (%s)", candidate, "; ".join(skipped))
            return BACKENDS[candidate]
        skipped.append(f"{candidate}: {why}")
    raise AssertionError("the torch backend is always available")
