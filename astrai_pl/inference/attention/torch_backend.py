"""The always-available attention backend: gather K/V from the pool, then `scaled_dot_product_attention`.

Decodes (one query each) share one padded SDPA call; multi-token requests (prefill chunks) are bucketed
by length so padding at most doubles their work. Grouped-query heads are folded into the query length
— q (n, Hkv, group·E, D) against K (n, Hkv, C, D) — so K/V are never repeated per query head (PyTorch's
`enable_gqa` is much slower on CPU with an explicit mask). A group of whole prompts (every request starting
at position 0, no window, no soft-cap) needs no mask: SDPA's own causal attention with `enable_gqa` skips
the keys after each query, half the work of the masked call (0.10 s against 0.20 s of CPU for 8 prompts of
700 tokens, 8 query and 2 key/value heads of 64). Such prompts are attended one by one over the K/V this step
computed for them: nothing gathered from the pool and no padding to the bucket's longest prompt.

K/V are gathered a page at a time (a page's slots are contiguous): the same bytes as a token gather
with page_size× fewer indices. Pages longer than `max_gather_page` (the contiguous layout) are gathered
token by token, so only the context is copied.

On CPU in float32, where the fused CPU kernels build, the step's tokens go to `cpu_ops.paged_decode_attention`
instead, in one call per layer: each token, a decode or one of a prompt chunk's, is a query over its request's
positions up to its own, read where they lie in the pool (through req_to_token; the step's K/V are stored
first), so nothing is gathered, padded or mirrored, and requests sharing prefix pages read them from cache
after the first one. Only whole prompts longer than `KERNEL_PROMPT_TOKENS` keep SDPA's causal attention, which
blocks long ones better than the kernel's query at a time.

Elsewhere, while the same requests keep decoding, their contexts are not gathered again every step: a
`DecodeMirror` keeps dense copies, built with one gather once a decode batch has stayed the same for
two steps, then extended by each step's new token. It is valid only for the very next step of exactly
the same requests, each one token longer; anything else (a request joins, finishes, is preempted)
drops it, and the decode group is gathered from the pool until the batch settles again. The mirror's
memory (at most `MIRROR_BYTES`) is kept by the engine and reused by the next mirror.

A sliding-window layer narrows each group's mask to the last `window` positions of each query (made once
per step and window); the CPU kernel reads only those positions. Soft-capped scores (Gemma 2) take an
explicit softmax (`capped_attention`), which SDPA cannot do; the CPU kernel caps them itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...model.attention import capped_attention
from ...ops import cpu as cpu_ops
from .view import StepView

MIRROR_BYTES = 256 * 1024**2  # above this the decode group is gathered every step instead
# On the CPU kernel, whole prompts longer than this take SDPA's causal attention instead (at 2,000 tokens the kernel,
# a query at a time, took 1.3x SDPA's time; at 16 prompts of 16-200, half of it; even near 1,000)
KERNEL_PROMPT_TOKENS = 1024


@dataclass
class DecodeMirror:
    """Dense K/V of the decoding requests: (layers, n, Hkv, capacity, D), valid up to each kv_len."""

    keys: tuple[str, ...]
    kv_lens: list[int]
    step: int
    k: torch.Tensor
    v: torch.Tensor

    def follows(self, keys: tuple[str, ...], kv_lens: list[int], step: int) -> bool:
        """Whether this step is the next one of exactly these requests, each one token longer, and fits."""
        return (
            step == self.step + 1
            and keys == self.keys
            and max(kv_lens) <= self.k.shape[3]
            and all(now == before + 1 for now, before in zip(kv_lens, self.kv_lens))
        )


@dataclass
class _Group:
    """Requests attended together: in one padded SDPA call, queries (n, E) and keys (n, C), or by the CPU kernel
    (`kv_lens` set), a query per token."""

    kv_index: torch.Tensor | None  # (n, C / unit) pages of `unit` slots (padding: a real page, masked)
    mask: torch.Tensor | None  # (n, 1, G·E, C) bool, True = may attend (None for the CPU kernel's group)
    q_index: torch.Tensor | None  # (n, E) into the step's tokens; None: decode group (E = 1, in order), or the CPU
    # kernel's group holding every token of the step (else its tokens, (n,))
    out_index: torch.Tensor | None  # (valid,) rows of the flattened (n·E) output that are real tokens
    dst: torch.Tensor | None  # (valid,) where those rows go in the step's output
    width: int  # E
    mirror: DecodeMirror | None = None  # decode group read from dense copies instead of the pool
    new_rows: torch.Tensor | None = None  # (n·Hkv,) rows of a mirror layer seen as (n·Hkv·capacity, D) where
    # this step's K/V go: one index_copy_ per layer instead of an advanced-index store
    kv_lens: torch.Tensor | None = None  # (n,) int32: tokens the CPU kernel attends, each over this many positions
    token_rows: torch.Tensor | None = None  # (n,) int64: the req_to_token row of each of those tokens
    q_pos: torch.Tensor | None = None  # position of each mask row's query, broadcastable to the mask
    windowed: dict | None = None  # window -> the mask narrowed to it, made on first use in a step
    spans: list[tuple[int, int]] | None = None  # every member starts at position 0 (no prefix): where each one's
    # tokens lie in the step (start, length), for plain causal attention over the step's own K/V

    def mask_for(self, window: int | None) -> torch.Tensor:
        """The mask of a layer seeing the last `window` positions of each query (None: all of them)."""
        if window is None:
            return self.mask
        if self.windowed is None:
            self.windowed = {}
        if window not in self.windowed:
            k_pos = torch.arange(self.mask.shape[-1], device=self.mask.device)
            self.windowed[window] = self.mask & (k_pos > self.q_pos - window)
        return self.windowed[window]


class TorchBackend:
    name = "torch"
    max_gather_page = 64

    def unavailable_reason(self, device: torch.device, dtype: torch.dtype) -> str | None:
        return None

    def prepare(self, view: StepView, num_q_heads: int) -> tuple[int, list[_Group]]:
        group_size = num_q_heads // view.storage.k.shape[2]
        unit = view.page_size if view.page_size <= self.max_gather_page else 1
        extend = list(range(view.num_decode, len(view.extend_lens)))  # the requests SDPA attends
        groups = []
        if _kernel_reads_pool(view):  # no gather, no mirror: the kernel reads each context where it lies
            long_prompts = {i for i in extend if not view.prefix_lens[i] and view.extend_lens[i] > KERNEL_PROMPT_TOKENS}
            kernel = [i for i in range(len(view.extend_lens)) if i not in long_prompts]
            groups, extend = [_kernel_group(view, kernel)] if kernel else [], sorted(long_prompts)
        elif view.num_decode:
            groups = [self._decode_group(view, unit)]
        groups += [self._extend_group(view, members, group_size, unit) for members in _bucket(view.extend_lens, extend)]
        return unit, groups

    def _decode_group(self, view: StepView, unit: int) -> _Group:
        nd = view.num_decode
        kv_lens = view.kv_lens[:nd]
        lens = torch.tensor(kv_lens, device=view.rows.device)
        mirror = _mirror(view, kv_lens)
        width = max(kv_lens) if mirror is not None else -(-max(kv_lens) // unit) * unit
        mask = (torch.arange(width, device=lens.device) < lens[:, None])[:, None, None, :]
        q_pos = (lens - 1)[:, None, None, None]  # (n, 1, 1, 1)
        if mirror is not None:
            _, _, Hkv, capacity, _ = mirror.k.shape
            heads = torch.arange(nd, device=lens.device)[:, None] * Hkv + torch.arange(
                Hkv, device=lens.device
            )
            new_rows = (heads * capacity + (lens - 1)[:, None]).reshape(-1)
            return _Group(None, mask, None, None, None, 1, mirror=mirror, new_rows=new_rows, q_pos=q_pos)
        return _Group(_gather_index(view, view.rows[:nd], width, unit), mask, None, None, None, 1, q_pos=q_pos)

    def _extend_group(self, view: StepView, members: list[int], group_size: int, unit: int) -> _Group:
        device = view.rows.device
        ext = torch.tensor([view.extend_lens[i] for i in members], device=device)
        prefix = torch.tensor([view.prefix_lens[i] for i in members], device=device)
        start = view.qo_indptr[members].to(torch.int64)
        width = int(ext.max())
        ctx = -(-int((ext + prefix).max()) // unit) * unit
        j = torch.arange(width, device=device)
        q_index = start[:, None] + torch.minimum(j[None], ext[:, None] - 1)  # padding repeats the last query
        q_pos = prefix[:, None] + j[None]  # (n, E)
        k_pos = torch.arange(ctx, device=device)
        mask = (k_pos <= q_pos[..., None]) & (k_pos < (prefix + ext)[:, None, None])  # (n, E, C)
        mask = mask[:, None].repeat(1, 1, group_size, 1)  # rows g·E + j
        valid = j[None] < ext[:, None]
        out_index = (torch.arange(len(members), device=device)[:, None] * width + j[None])[valid]
        kv_index = _gather_index(view, view.rows[members], ctx, unit)
        rows_pos = q_pos.repeat(1, group_size)[:, None, :, None]  # (n, 1, G·E, 1), rows g·E + j
        spans = None
        if not any(view.prefix_lens[i] for i in members):
            starts = view.qo_indptr.tolist()
            spans = [(starts[i], view.extend_lens[i]) for i in members]
        return _Group(kv_index, mask, q_index, out_index, q_index[valid], width, q_pos=rows_pos, spans=spans)

    def attend(
        self, view: StepView, layer_idx: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, *,
        window: int | None = None, scale: float | None = None, softcap: float | None = None,
    ) -> torch.Tensor:
        unit, groups = view.meta
        T, Hq, D = q.shape
        Hkv = view.storage.k.shape[2]
        G = Hq // Hkv
        out = None if len(groups) == 1 and groups[0].q_index is None else q.new_empty(T, Hq, D)
        for g in groups:
            if g.kv_lens is not None:  # the CPU kernel: each of these tokens over its request's context in the pool
                tokens = g.q_index
                o = cpu_ops.paged_decode_attention(
                    q if tokens is None else q.index_select(0, tokens), view.storage.k[layer_idx],
                    view.storage.v[layer_idx], view.req_to_token, g.token_rows, g.kv_lens, g.width,
                    window=window, scale=scale, softcap=softcap,
                )
                if out is None:
                    return o
                out.index_copy_(0, tokens, o)
                continue
            if g.spans is not None and window is None and softcap is None:  # whole prompts: causal from position 0
                for start, length in g.spans:  # each over its own K/V, as this step computed them: no gather, no padding
                    rows = slice(start, start + length)
                    qh, kh, vh = (t[rows].transpose(0, 1)[None] for t in (q, k_new, v_new))
                    o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=G > 1)
                    out[rows] = o[0].transpose(0, 1)
                continue
            k, v = _context(view, layer_idx, g, unit, k_new, v_new)  # (n, Hkv, C, D)
            n, E = k.shape[0], g.width
            mask = g.mask_for(window)
            if g.q_index is None:  # decode: the first n tokens, one per request
                o = _sdpa(q[:n].view(n, Hkv, G, D), k, v, mask, scale, softcap)
                if out is None:
                    return o.reshape(n, Hq, D)
                out[:n] = o.reshape(n, Hq, D)
                continue
            qg = q[g.q_index].view(n, E, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(n, Hkv, G * E, D)
            o = _sdpa(qg, k, v, mask, scale, softcap)  # (n, Hkv, G·E, D)
            o = o.view(n, Hkv, G, E, D).permute(0, 3, 1, 2, 4).reshape(n * E, Hq, D)
            out.index_copy_(0, g.dst, o[g.out_index])
        return out


def _sdpa(q, k, v, mask, scale: float | None, softcap: float | None) -> torch.Tensor:
    """SDPA of q (n, H, L, D) over k, v (n, H, C, D), or the explicit softmax when the scores are capped."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return capped_attention(q, k, v, mask, q.shape[-1] ** -0.5 if scale is None else scale, softcap)


def _kernel_reads_pool(view: StepView) -> bool:
    """Whether the step's tokens go to `cpu_ops.paged_decode_attention` (float32 on CPU, kernels built)."""
    k = view.storage.k
    return cpu_ops.paged_decode_attention_usable(k[0, :1], k[0], view.storage.v[0])


def _context(
    view: StepView, layer: int, g: _Group, unit: int, k_new, v_new
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V (n, Hkv, C, D) of a group's requests: from the mirror, or gathered from the pool."""
    if g.mirror is not None:
        k, v = g.mirror.k[layer], g.mirror.v[layer]  # (n, Hkv, capacity, D), contiguous
        n, D, width = k.shape[0], k.shape[-1], g.mask.shape[-1]
        k.view(-1, D).index_copy_(0, g.new_rows, k_new[:n].reshape(-1, D))
        v.view(-1, D).index_copy_(0, g.new_rows, v_new[:n].reshape(-1, D))
        return k[:, :, :width], v[:, :, :width]
    Hkv, D = view.storage.k.shape[2:]
    n = g.kv_index.shape[0]
    k = view.storage.k[layer].view(-1, unit, Hkv, D)[g.kv_index].view(n, -1, Hkv, D)
    v = view.storage.v[layer].view(-1, unit, Hkv, D)[g.kv_index].view(n, -1, Hkv, D)
    return k.transpose(1, 2), v.transpose(1, 2)


def _mirror(view: StepView, kv_lens: list[int]) -> DecodeMirror | None:
    """The decode mirror for this step: the last step's, extended, or a new one; None when not kept."""
    if view.scratch is None:
        return None
    nd, keys = len(kv_lens), view.keys[: len(kv_lens)]
    previous = view.scratch.get("decode_batch")
    view.scratch["decode_batch"] = (keys, view.step)
    mirror = view.scratch.pop("decode_mirror", None)
    if mirror is not None and mirror.follows(keys, kv_lens, view.step):
        mirror.kv_lens, mirror.step = kv_lens, view.step
        view.scratch["decode_mirror"] = mirror
        return mirror
    if previous != (keys, view.step - 1):  # a batch that just changed may change again: copy it later
        return None
    layers, _, Hkv, D = view.storage.k.shape
    capacity = -(-(max(kv_lens) + 128) // 64) * 64
    if 2 * layers * nd * Hkv * capacity * D * view.storage.k.element_size() > MIRROR_BYTES:
        return None
    k, v = _mirror_buffers(view, (layers, nd, Hkv, capacity, D))
    width = max(kv_lens) - 1  # the new token is written by each layer as it comes
    slots = view.req_to_token[view.rows[:nd], :width].to(torch.int64)
    k[:, :, :, :width] = view.storage.k[:, slots].transpose(2, 3)
    v[:, :, :, :width] = view.storage.v[:, slots].transpose(2, 3)
    mirror = DecodeMirror(keys, kv_lens, view.step, k, v)
    view.scratch["decode_mirror"] = mirror
    return mirror


def _mirror_buffers(view: StepView, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V mirror tensors of `shape`, carved from buffers kept in the engine's scratch across steps
    and calls (a rollout after a rollout reuses them: no new allocation, no page faults on fresh memory).

    Positions past a request's length are masked but still multiplied, so they must be finite: the
    buffers start as zeros and only ever receive K/V values, so whatever a reused buffer holds is finite.
    """
    numel = math.prod(shape)
    buffers = view.scratch.get("mirror_buffers")
    if buffers is None or buffers[0].numel() < numel:
        buffers = tuple(view.storage.k.new_zeros(numel) for _ in range(2))
        view.scratch["mirror_buffers"] = buffers
    return buffers[0][:numel].view(shape), buffers[1][:numel].view(shape)


def _gather_index(view: StepView, rows: torch.Tensor, width: int, unit: int) -> torch.Tensor:
    """(n, width / unit) indices of the `unit`-slot blocks holding positions 0 … width-1 of each row."""
    slots = view.req_to_token[rows, :width:unit]
    return slots if unit == 1 else slots // unit


def _kernel_group(view: StepView, members: list[int]) -> _Group:
    """The tokens of `members` (requests of the step) as queries of the CPU kernel: each one over its request's
    positions up to its own, read where they lie in the pool (this step's K/V are stored before attention)."""
    lens = [view.extend_lens[i] for i in members]
    starts = view.qo_indptr[members].tolist()
    tokens = torch.cat([torch.arange(start, start + n) for start, n in zip(starts, lens)])
    ext = torch.tensor(lens)
    at = torch.tensor([view.prefix_lens[i] - start for i, start in zip(members, starts)])  # position - token index
    kv_lens = (tokens + at.repeat_interleave(ext) + 1).to(torch.int32)  # each token's position + 1
    rows = view.rows[members].to(torch.int64).repeat_interleave(ext)
    contiguous = int(tokens[0]) == 0 and len(tokens) == int(view.qo_indptr[-1])
    return _Group(None, None, None if contiguous else tokens, None, None, int(kv_lens.max()), kv_lens=kv_lens,
                  token_rows=rows)


def _bucket(extend_lens: list[int], members: list[int], max_waste: float = 2.0) -> list[list[int]]:
    """Group multi-token requests (`members`) so padding to the longest costs at most `max_waste`×."""
    order = sorted(members, key=lambda i: -extend_lens[i])
    buckets: list[list[int]] = []
    for i in order:
        if buckets:
            members = buckets[-1]
            padded = (len(members) + 1) * extend_lens[members[0]]
            if padded <= max_waste * (sum(extend_lens[m] for m in members) + extend_lens[i]) or padded <= 256:
                members.append(i)
                continue
        buckets.append([i])
    return buckets
