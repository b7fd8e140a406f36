"""The `cuda` attention backend: the fused decode kernel of `astrai_pl.ops` (or a library decode) for the
step's decodes and a library prefill kernel (`astrai_pl.ops.prefill`: SDPA, FlexAttention or flash-attn) for
its prompts, both reading the pool in place."""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch

from ...ops.decode_libs import DECODE_LIBS
from ...ops.prefill import PagedBatch, prefill
from .view import FEATURES, StepView


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
        from ...ops.decode_libs import decode_choice
        from ...ops.prefill import prefill_choice

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
