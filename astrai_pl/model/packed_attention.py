"""Block-causal attention over packed rows without a dense (B, 1, T, T) mask.

A row packed with several documents (`document_ids` (B, T)) attends causally within each document. The
dense path builds that as a (B, 1, T, T) bool mask for `scaled_dot_product_attention`, which keeps SDPA
off its flash kernels on a GPU. Two kernels take the documents instead:

    flex     FlexAttention (torch) with a document block mask: blocks that cross a document boundary
             are skipped, the rest run a fused flash-style kernel (compiled on first use on CUDA)
    varlen   flash-attn's `flash_attn_varlen_func` over the rows flattened into one ragged batch of
             documents (`cu_seqlens`), when flash-attn is installed (bf16/fp16 on CUDA)
    sdpa     the dense mask (the reference, and the default on CPU)

Both kernels cover sliding windows (key j visible from query i when i − j < window) and Gemma 2's score
soft-cap. The choice is made per forward by `packed_backend`: a forced choice (`override_packed_attention`,
for tests and benchmarks), else varlen on CUDA when flash-attn imports, else flex on CUDA, else sdpa.
On CPU the dense mask stays the default: FlexAttention has no fused CPU kernel in eager mode and no CPU
backward at all (one forward of 4 rows × 512 tokens, 8 query / 2 kv heads of 64, ~1 % document starts,
torch 2.13 on one CPU thread: dense SDPA 121 ms, eager flex 471 ms), so a forced flex path on CPU with gradients
falls back to sdpa with one log line.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from ..ops.choice import Choice

BACKENDS = ("sdpa", "flex", "varlen")
_logged: set[str] = set()


@functools.cache
def flash_varlen_available() -> bool:
    """Whether flash-attn's varlen entry imports (the optional `flash` extra)."""
    try:
        from flash_attn import flash_attn_varlen_func  # noqa: F401
    except Exception:  # ImportError, or a build for another torch/CUDA that fails to load
        return False
    return True


def _flash_varlen():
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func


def flex_has_backward(device: torch.device) -> bool:
    """Whether FlexAttention differentiates on `device` (torch has no CPU backward)."""
    return device.type != "cpu"


def _varlen_why_not(device: torch.device, dtype: torch.dtype, needs_grad: bool) -> str | None:
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) and flash_varlen_available():
        return None
    return "flash-attn needs CUDA, bf16/fp16 and the `flash` extra"


def _flex_why_not(device: torch.device, dtype: torch.dtype, needs_grad: bool) -> str | None:
    return "FlexAttention has no backward on CPU" if needs_grad and not flex_has_backward(device) else None


_CHOICE = Choice("packed attention backend", {"sdpa": None, "flex": _flex_why_not, "varlen": _varlen_why_not},
                 {"cuda": ("varlen", "flex"), "*": ("sdpa",)}, logged=lambda: _logged,
                 labels={"flex": "packed attention flex → sdpa", "varlen": "packed attention varlen"})  # fmt: skip
log_fallback = _CHOICE.log_once  # (what, reason): one log line per process and fallback
override_packed_attention = _CHOICE.force  # force "sdpa", "flex" or "varlen"; None: the run-time choice


def packed_backend(device: torch.device, dtype: torch.dtype, needs_grad: bool) -> str:
    """The kernel packed rows take on `device` (see the module docstring); logs once where a forced one cannot run."""
    return _CHOICE.choose(device, dtype, needs_grad)


@dataclass
class PackedRows:
    """The documents of packed rows, for a kernel that takes them without a dense mask."""

    document_ids: torch.Tensor  # (B, T)
    backend: str  # "flex" or "varlen"
    block_masks: dict[int | None, object] = field(default_factory=dict)  # flex: one per window, shared by layers
    cu_seqlens: torch.Tensor | None = None  # varlen: (D + 1,) int32 document starts in the flattened rows

    def prepare(self, windows: set[int | None]) -> PackedRows:
        """Build what the kernel reads (block masks of these windows, or cu_seqlens) before the blocks run, so
        that compiled blocks only read them."""
        if self.backend == "varlen":
            self.cu_seqlens = document_starts(self.document_ids)
        else:
            for window in windows:
                self.block_masks[window] = document_block_mask(self.document_ids, window)
        return self

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, window: int | None,
               scale: float | None, softcap: float | None) -> torch.Tensor:
        """Block-causal attention of q (B, Hq, T, D) over k, v (B, Hkv, T, D) → (B, Hq, T, D)."""
        q, k = q.to(v.dtype), k.to(v.dtype)  # RoPE under autocast leaves q and k in float32
        if self.backend == "varlen":
            return self._varlen(q, k, v, window, scale, softcap)
        return self._flex(q, k, v, window, scale, softcap)

    def _flex(self, q, k, v, window, scale, softcap):
        from torch.nn.attention.flex_attention import flex_attention

        if window not in self.block_masks:
            self.block_masks[window] = document_block_mask(self.document_ids, window)
        score_mod = None if softcap is None else _capped_scores(softcap)
        kernel = _compiled_flex() if q.is_cuda else flex_attention
        return kernel(q, k, v, score_mod=score_mod, block_mask=self.block_masks[window], scale=scale,
                      enable_gqa=k.shape[1] != q.shape[1])

    def _varlen(self, q, k, v, window, scale, softcap):
        B, Hq, T, D = q.shape
        if self.cu_seqlens is None:
            self.cu_seqlens = document_starts(self.document_ids)
        flat = [t.transpose(1, 2).reshape(B * T, t.shape[1], D) for t in (q, k, v)]  # (B·T, H, D)
        out = _flash_varlen()(
            *flat, self.cu_seqlens, self.cu_seqlens, T, T, softmax_scale=scale, causal=True,
            window_size=(-1, -1) if window is None else (window - 1, 0), softcap=softcap or 0.0,
        )  # max_seqlen T: an upper bound that needs no read of the lengths on the host
        return out.view(B, T, Hq, D).transpose(1, 2)


def document_starts(document_ids: torch.Tensor) -> torch.Tensor:
    """cu_seqlens of the documents of rows (B, T) flattened into one sequence: each row's start and each
    change of document id begins one.  (D + 1,) int32, the last entry B·T."""
    B, T = document_ids.shape
    flat = document_ids.reshape(-1)
    starts = torch.ones_like(flat, dtype=torch.bool)
    starts[1:] = flat[1:] != flat[:-1]
    starts[::T] = True
    where = starts.nonzero().squeeze(-1)  # one host read per forward, shared by every layer
    return torch.cat([where, where.new_tensor([B * T])]).to(torch.int32)


def document_block_mask(document_ids: torch.Tensor, window: int | None):
    """FlexAttention's BlockMask of block-causal attention within documents, narrowed to a sliding window."""
    from torch.nn.attention.flex_attention import create_block_mask

    docs = document_ids

    def visible(b, h, q_idx, kv_idx):
        keep = (q_idx >= kv_idx) & (docs[b, q_idx] == docs[b, kv_idx])
        return keep if window is None else keep & (q_idx - kv_idx < window)

    B, T = document_ids.shape
    return create_block_mask(visible, B, None, T, T, device=document_ids.device, _compile=document_ids.is_cuda)


def _capped_scores(cap: float):
    def capped(score, b, h, q_idx, kv_idx):
        return torch.tanh(score / cap) * cap

    return capped


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)
