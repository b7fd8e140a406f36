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
import importlib
import importlib.util
import logging
import os
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

import torch

from ..ops.decode_libs import DECODE_LIBS
from ..ops.prefill import PagedBatch, prefill
from .cache import InferenceError
from .step_view import AttentionBackend, StepView
from .torch_backend import TorchBackend

log = logging.getLogger(__name__)

BACKEND_NAMES = ("cuda", "flash", "torch")  # in priority order
FLASH_ATTN_AVAILABLE = importlib.util.find_spec("flash_attn") is not None


class BackendUnavailable(InferenceError):
    """An attention backend was forced but cannot run on this device, dtype or installation."""


# -- flash-attn: ragged K/V gathered through kv_indptr -------------------------------------------
@dataclass
class _Ragged:
    kv_indices: torch.Tensor  # (sum of kv lens,) slots, requests concatenated
    max_q: int
    max_kv: int


def _ragged(view: StepView) -> _Ragged:
    kv_lens = view.kv_lens
    width = max(kv_lens)
    table = view.req_to_token[view.rows, :width]
    lens = torch.tensor(kv_lens, device=table.device)
    valid = torch.arange(width, device=table.device)[None] < lens[:, None]
    return _Ragged(table[valid].to(torch.int64), max(view.extend_lens), width)


FEATURES = ("sliding_window", "softcap", "scale")


def model_features(cfg) -> tuple[str, ...]:
    """What a model's attention asks of a backend beyond plain causal attention at 1/sqrt(head_dim)."""
    needs = {
        "sliding_window": any(cfg.layer_window(i) is not None for i in range(cfg.num_hidden_layers)),
        "softcap": cfg.attn_logit_softcapping is not None,
        "scale": cfg.query_pre_attn_scalar is not None,
    }
    return tuple(name for name in FEATURES if needs[name])


class FlashBackend:
    name = "flash"
    features = frozenset(FEATURES)

    def unavailable_reason(self, device: torch.device, dtype: torch.dtype) -> str | None:
        if device.type != "cuda":
            return f"flash-attn runs on CUDA only, the engine is on {device.type}"
        if not FLASH_ATTN_AVAILABLE:
            return "the flash_attn package is not installed (pip install 'astrai_pl[flash]')"
        if dtype not in (torch.float16, torch.bfloat16):
            return f"flash-attn needs float16 or bfloat16, the engine runs {dtype}"
        return None

    def prepare(self, view: StepView, num_q_heads: int) -> _Ragged:
        return _ragged(view)

    def attend(self, view: StepView, layer_idx: int, q: torch.Tensor, k_new, v_new, *, window=None, scale=None,
               softcap=None) -> torch.Tensor:
        from flash_attn import flash_attn_varlen_func

        meta: _Ragged = view.meta
        k = view.storage.k[layer_idx][meta.kv_indices]
        v = view.storage.v[layer_idx][meta.kv_indices]
        # causal with more keys than queries aligns the queries with the last keys (flash-attn >= 2.1)
        extra = {} if window is None else {"window_size": (window - 1, 0)}  # flash-attn >= 2.3
        if softcap is not None:
            extra["softcap"] = softcap  # flash-attn >= 2.6; older versions raise naming the argument
        return flash_attn_varlen_func(
            q, k, v, view.qo_indptr, view.kv_indptr, meta.max_q, meta.max_kv, causal=True, softmax_scale=scale,
            **extra,
        )


@dataclass
class _CudaStep:
    num_decode: int  # the first requests, one token each: the decode kernel
    max_kv: int  # longest context of those (from the scheduler's lists: no device read)
    prefill: PagedBatch | None  # the other requests, for the prefill path (None: a decode-only step)
    choice: str  # the prefill implementation (astrai_pl.ops.prefill.prefill_choice)
    decode: str = "kernel"  # the decode implementation (astrai_pl.ops.decode_libs.decode_choice)
    decodes: PagedBatch | None = None  # the decoding requests, for a library decode


class CudaBackend:
    """The fused decode kernel of `astrai_pl.ops` and a library kernel for prompts, reading the pool in place.

    The request table is the page table (a token slot is a one-token page). The step's decodes (its first
    requests) run `paged_decode`, or the library `ASTRAI_DECODE` names (`astrai_pl.ops.decode_libs`); the other requests run the prefill implementation that
    `astrai_pl.ops.prefill.prefill_choice` picks (`ASTRAI_PREFILL`). Every length comes from the
    scheduler's lists, so preparing a step reads nothing back from the device.
    """

    name = "cuda"
    features = frozenset(FEATURES)

    def unavailable_reason(self, device: torch.device, dtype: torch.dtype) -> str | None:
        if device.type != "cuda":
            return f"the fused kernels run on CUDA only, the engine is on {device.type}"
        try:
            ops = importlib.import_module("astrai_pl.ops")
        except ImportError as err:
            return f"astrai_pl.ops cannot be imported ({err})"
        why = ops.unavailable_reason()
        return None if why is None else f"the fused kernels cannot run ({why})"

    def prepare(self, view: StepView, num_q_heads: int) -> _CudaStep:
        from ..ops.decode_libs import decode_choice
        from ..ops.prefill import prefill_choice

        nd, kv_lens = view.num_decode, view.kv_lens
        device, dtype = view.rows.device, view.storage.k.dtype
        batch = None
        if nd < len(kv_lens):
            rest = kv_lens[nd:]
            table = view.req_to_token[view.rows[nd:], : max(rest)]
            batch = PagedBatch(view.extend_lens[nd:], rest, table, view.page_size)
        step = _CudaStep(nd, max(kv_lens[:nd], default=0), batch, prefill_choice(device, dtype))
        if nd and (decode := decode_choice(device, dtype, view.page_size)) != "kernel":
            table = view.req_to_token[view.rows[:nd], : step.max_kv]
            step.decode, step.decodes = decode, PagedBatch([1] * nd, kv_lens[:nd], table, view.page_size)
        return step

    def attend(self, view: StepView, layer_idx: int, q: torch.Tensor, k_new, v_new, *, window=None, scale=None,
               softcap=None) -> torch.Tensor:  # fmt: skip
        ops = importlib.import_module("astrai_pl.ops")
        step: _CudaStep = view.meta
        k_pool, v_pool = view.storage.k[layer_idx], view.storage.v[layer_idx]
        shape = dict(window=window, scale=scale, softcap=softcap)
        nd = step.num_decode
        decoded = None
        if step.decodes is not None:
            decoded = DECODE_LIBS[step.decode](q[:nd], k_pool, v_pool, step.decodes, **shape)
        elif nd:
            decoded = ops.paged_decode(
                q[:nd], k_pool, v_pool, view.kv_indptr[: nd + 1], req_to_token=view.req_to_token,
                rows=view.rows[:nd], max_kv_len=step.max_kv, **shape,
            )  # fmt: skip
        if step.prefill is None:
            return decoded
        rest = prefill(q[nd:], k_pool, v_pool, step.prefill, choice=step.choice, **shape)
        return rest if decoded is None else torch.cat([decoded, rest])


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
