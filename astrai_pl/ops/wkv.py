"""RWKV-4's WKV recurrence over a sequence as one fused kernel each way, for `astrai_pl.model.rwkv.wkv`: on
CPU `cpu_kernels.c` (wkv_forward, wkv_backward), on a CUDA device `cuda/wkv.cu` (one thread per channel).

The PyTorch loop over time launches about twenty small ops per token and keeps every one's output for the
backward; the kernels run the recurrence in registers, 64 channels a thread at a time, and the backward
recomputes the forward instead of storing it: one pass forward (gradients of the decay w and bonus u, and
each token's direct terms) and one pass backward in time (what a token's key and value add to the later
tokens' outputs, kept in a scale of its own so it stays within float32 range). Gradients match a float64
plain recurrence (tests/model/test_wkv_kernel.py).

Gradients flow to w, u, k and v, not to a start state nor through the state returned: a start state that
requires grad is not taken (`usable` is False and the caller keeps its loop), and the state out is
detached, as a truncated backpropagation through time detaches it anyway.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from . import build, cpu

NO_EXPONENT = -1e38  # pp before any token (cpu_kernels.c: WKV_NONE)


def usable(w: torch.Tensor, u: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           state: tuple[torch.Tensor, ...] | None) -> bool:
    """Whether `wkv` takes these: float32 tensors on CPU with the CPU kernels built (`cpu._takes`) or on a
    CUDA device with the CUDA kernels loaded, k and v (B, T, H) alike, w and u (H,), and no gradient wanted
    for the start state."""
    start = () if state is None else tuple(state)
    shapes = (
        k.dim() == 3 and k.shape == v.shape and k.numel() > 0 and w.shape == u.shape == k.shape[-1:]
        and all(s.shape == k.shape[::2] for s in start) and not cpu._needs_grad(*start)
    )  # fmt: skip
    if not shapes:
        return False
    if k.is_cuda:
        tensors = (w, u, k, v, *start)
        return (all(type(t) in cpu._PLAIN and t.dtype == torch.float32 and t.device == k.device for t in tensors)
                and not torch.compiler.is_compiling() and build.forced() is not False and build.available())
    return cpu._takes(w, u, k, v, *start)


def _start(k: torch.Tensor, state: tuple[torch.Tensor, ...] | None) -> torch.Tensor:
    """The start state as one (3, B, H) tensor: aa, bb, pp."""
    B, _, H = k.shape
    if state is None:
        start = k.new_zeros(3, B, H)
        start[2] = NO_EXPONENT
        return start
    return torch.stack([s.detach() for s in state])


def _forward(w, u, k, v, start, flags):
    """The kernel's forward: y (B, T, H) and the state after the last token (3, B, H)."""
    B, T, H = k.shape
    if k.is_cuda:
        state = start.clone()
        return build.load().wkv_forward(w, u, k, v, flags, state, _stream(k)), state
    y, state = torch.empty_like(k), start.clone()
    cpu.load().wkv_forward(cpu._ptr(w), cpu._ptr(u), cpu._ptr(k), cpu._ptr(v),
                           None if flags is None else cpu._ptr(flags), cpu._ptr(y), cpu._ptr(state), B, T, H,
                           cpu._threads(k.numel()))
    return y, state


def _stream(t: torch.Tensor) -> int:
    return torch.cuda.current_stream(t.device).cuda_stream


class _WKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, u, k, v, start, flags):
        w, u, k, v = (t.detach().contiguous() for t in (w, u, k, v))
        y, state = _forward(w, u, k, v, start, flags)
        ctx.save_for_backward(w, u, k, v, start)
        ctx.flags = flags
        ctx.mark_non_differentiable(state)
        return y, state

    @staticmethod
    @once_differentiable
    def backward(ctx, gy, _):
        w, u, k, v, start = ctx.saved_tensors
        B, T, H = k.shape
        gy = gy.contiguous()
        if k.is_cuda:
            gk, gv, gw, gu = build.load().wkv_backward(w, u, k, v, ctx.flags, start, gy, _stream(k))
            return gw, gu, gk, gv, None, None
        gk, gv, scratch = torch.empty_like(k), torch.empty_like(v), k.new_empty(3, B, T, H)
        gw, gu = k.new_empty(B, H), k.new_empty(B, H)
        flags = None if ctx.flags is None else cpu._ptr(ctx.flags)
        cpu.load().wkv_backward(cpu._ptr(w), cpu._ptr(u), cpu._ptr(k), cpu._ptr(v), flags, cpu._ptr(start),
                                cpu._ptr(gy), cpu._ptr(gk), cpu._ptr(gv), cpu._ptr(gw), cpu._ptr(gu),
                                cpu._ptr(scratch), B, T, H, cpu._threads(k.numel()))
        return gw.sum(0), gu.sum(0), gk, gv, None, None


def wkv(w: torch.Tensor, u: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        state: tuple[torch.Tensor, ...] | None = None, resets: torch.Tensor | None = None,
        ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """wkv_t (B, T, H) and the state after the last token (aa, bb, pp), each (B, H); the arguments as
    `astrai_pl.model.rwkv.wkv` takes them, float32 (check `usable` first)."""
    start = _start(k, state)
    flags = None if resets is None else resets.detach().to(torch.bool).contiguous()
    assert flags is None or flags.shape == k.shape[:2], f"resets {tuple(flags.shape)} for k {tuple(k.shape)}"
    if cpu._needs_grad(w, u, k, v):
        y, end = _WKV.apply(w, u, k, v, start, flags)
    else:
        y, end = _forward(*(t.detach().contiguous() for t in (w, u, k, v)), start, flags)
    return y, (end[0], end[1], end[2])
