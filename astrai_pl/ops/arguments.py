"""Argument checks of the fused ops, run in Python before anything reaches the extension.

Everything the host already knows is checked on every call, for free: devices, dtypes, ranks, shapes,
contiguity, 16-byte alignment, head_dim against the kernel's set, index dtypes. A failed check raises
`KernelArgumentError` (a RuntimeError) whose message names the op and the argument, so a bad call never
gets as far as a launch. The binding (cuda/bindings.cpp) repeats the same checks for callers that use
the extension directly.

Values that live on the device (slots, rows, context lengths) are not read back on every call: that
would cost a host synchronisation per layer. The kernels instead receive the pool's size, the index
array's length and the table's width, and skip any key whose slot falls outside the pool, treat a row
outside the table as an empty context and clip a context to the table's width; so a wrong index gives
wrong numbers, never a read outside a buffer. `check_indices(True)` (or `ASTRAI_CHECK_INDICES=1`) adds
the full range check on the host before every call, with an error naming the argument: for tests and
debugging.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

ATTENTION_HEAD_DIMS = (64, 128, 256)  # the head_dims paged_decode is compiled for
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_NAMES = {  # the names torch's C++ side prints, so both layers of checks read the same
    torch.float32: "Float", torch.float16: "Half", torch.bfloat16: "BFloat16", torch.float64: "Double",
    torch.int32: "Int", torch.int64: "Long", torch.int16: "Short", torch.int8: "Char", torch.uint8: "Byte",
    torch.bool: "Bool",
}  # fmt: skip


class KernelArgumentError(RuntimeError):
    """A fused op was called with an argument the kernel cannot take; the message names it."""


def dtype_name(dtype: torch.dtype) -> str:
    return _NAMES.get(dtype, str(dtype).removeprefix("torch."))


_check_indices: list[bool | None] = [None]


@contextlib.contextmanager
def check_indices(value: bool = True) -> Iterator[None]:
    """Inside the block, range-check every index tensor on the host before each call (one sync per call)."""
    previous, _check_indices[0] = _check_indices[0], value
    try:
        yield
    finally:
        _check_indices[0] = previous


def checking_indices() -> bool:
    forced = _check_indices[0]
    return forced if forced is not None else os.environ.get("ASTRAI_CHECK_INDICES") == "1"


def _fail(op: str, message: str) -> None:
    raise KernelArgumentError(f"{op}: {message}")


def check_tensor(
    op: str, name: str, t: torch.Tensor, anchor: torch.Tensor, *, device_type: str = "cuda"
) -> None:
    """t is a tensor on the anchor's device (of type device_type)."""
    if not isinstance(t, torch.Tensor):
        _fail(op, f"{name} must be a tensor, got {type(t).__name__}")
    if t.device.type != device_type:
        _fail(op, f"{name} must be a CUDA tensor, got one on {t.device}")
    if t.device != anchor.device:
        _fail(op, f"{name} is on {t.device} but q is on {anchor.device}")


def check_dense(op: str, name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        _fail(op, f"{name} must be contiguous (call .contiguous() first)")
    if t.numel() and t.data_ptr() % 16:
        _fail(op, f"{name} must start on a 16-byte boundary (a fresh tensor does; a sliced view may not)")


def check_attention(
    op: str, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, out: torch.Tensor | None, *,
    head_dims: tuple[int, ...] = ATTENTION_HEAD_DIMS, device_type: str = "cuda",
) -> None:  # fmt: skip
    """q (tokens, Hq, D), k_pool / v_pool (slots, Hkv, D) and out like q: device, dtype, shape, layout."""
    check_tensor(op, "q", q, q, device_type=device_type)
    if q.dim() != 3:
        _fail(op, f"q must be (tokens, num_q_heads, head_dim), got shape {list(q.shape)}")
    if k_pool.dim() != 3:
        _fail(op, f"k_pool must be (num_slots, num_kv_heads, head_dim), got shape {list(k_pool.shape)}")
    if v_pool.shape != k_pool.shape:
        _fail(op, f"v_pool has shape {list(v_pool.shape)} but k_pool has {list(k_pool.shape)}")
    if out is not None and out.shape != q.shape:
        _fail(op, f"out has shape {list(out.shape)} but q has {list(q.shape)}")
    named = [("q", q), ("k_pool", k_pool), ("v_pool", v_pool)] + ([("out", out)] if out is not None else [])
    for name, t in named:
        check_tensor(op, name, t, q, device_type=device_type)
        if t.dtype != q.dtype:
            _fail(op, f"{name} is {dtype_name(t.dtype)} but q is {dtype_name(q.dtype)}")
        check_dense(op, name, t)
    if q.dtype not in FLOAT_DTYPES:
        _fail(op, f"q must be float32, float16 or bfloat16, got {dtype_name(q.dtype)}")
    if q.shape[2] not in head_dims:
        _fail(op, f"head_dim must be {', '.join(map(str, head_dims[:-1]))} or {head_dims[-1]}, got {q.shape[2]}")
    if k_pool.shape[2] != q.shape[2]:
        _fail(op, f"k_pool head_dim {k_pool.shape[2]} differs from q's {q.shape[2]}")
    if k_pool.shape[1] == 0 or q.shape[1] % k_pool.shape[1]:
        _fail(op, f"num_q_heads ({q.shape[1]}) must be a multiple of num_kv_heads ({k_pool.shape[1]})")


def check_index(
    op: str, name: str, t: torch.Tensor, q: torch.Tensor, *, dims: int, layout: str, allow_int64: bool,
    device_type: str = "cuda",
) -> None:  # fmt: skip
    check_tensor(op, name, t, q, device_type=device_type)
    allowed = (torch.int32, torch.int64) if allow_int64 else (torch.int32,)
    if t.dtype not in allowed:
        wanted = "int32 or int64" if allow_int64 else "int32"
        _fail(op, f"{name} must be {wanted}, got {dtype_name(t.dtype)}")
    if t.dim() != dims:
        _fail(op, f"{name} must be {layout}, got shape {list(t.shape)}")
    if dims == 1 and not t.is_contiguous() or dims == 2 and t.stride(1) != 1:
        _fail(op, f"{name} must be contiguous")


def check_page_table(
    op: str, q: torch.Tensor, batch: int, kv_indptr: torch.Tensor, indices: torch.Tensor,
    rows: torch.Tensor | None, *, device_type: str = "cuda",
) -> None:  # fmt: skip
    """kv_indptr (batch + 1,) int32 with kv_indices (n,) or req_to_token (R, W) and rows (batch,)."""
    check_index(op, "kv_indptr", kv_indptr, q, dims=1, layout="(batch + 1,)", allow_int64=False,
                device_type=device_type)  # fmt: skip
    if kv_indptr.shape[0] != batch + 1:
        _fail(op, f"kv_indptr must have batch + 1 = {batch + 1} entries, got {kv_indptr.shape[0]}")
    if rows is None:
        check_index(op, "kv_indices", indices, q, dims=1, layout="(total context tokens,)", allow_int64=True,
                    device_type=device_type)  # fmt: skip
        return
    check_index(op, "req_to_token", indices, q, dims=2, layout="(rows, max_context)", allow_int64=True,
                device_type=device_type)  # fmt: skip
    check_index(op, "rows", rows, q, dims=1, layout=f"({batch},)", allow_int64=False, device_type=device_type)
    if rows.shape[0] != batch:
        _fail(op, f"rows must be a contiguous ({batch},) tensor, got shape {list(rows.shape)}")


def check_index_ranges(
    op: str, num_slots: int, kv_indptr: torch.Tensor, indices: torch.Tensor, rows: torch.Tensor | None,
    qo_indptr: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """The values of the page table against the pool (reads them on the host: one synchronisation)."""
    lens = (kv_indptr[1:] - kv_indptr[:-1]).tolist()
    if kv_indptr.numel() and int(kv_indptr[0]) != 0 or any(n < 0 for n in lens):
        _fail(op, "kv_indptr must start at 0 and never decrease")
    if qo_indptr is not None:
        q_lens = (qo_indptr[1:] - qo_indptr[:-1]).tolist()
        if any(n < 0 for n in q_lens) or any(qn > kn for qn, kn in zip(q_lens, lens)):
            _fail(op, "qo_indptr must never decrease, and no request may have more queries than context tokens")
    if rows is None:
        if int(kv_indptr[-1]) > indices.shape[0]:
            _fail(op, f"kv_indptr ends at {int(kv_indptr[-1])} but kv_indices has {indices.shape[0]} entries")
        used = indices[: int(kv_indptr[-1])]
    else:
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= indices.shape[0]):
            _fail(op, f"rows must lie in [0, {indices.shape[0]}) (req_to_token's rows)")
        if lens and max(lens) > indices.shape[1]:
            _fail(op, f"a context of {max(lens)} tokens exceeds req_to_token's width of {indices.shape[1]}")
        width = max(lens, default=0)
        table = indices[rows.long(), :width]
        valid = torch.arange(width, device=table.device)[None] < torch.tensor(lens, device=table.device)[:, None]
        used = table[valid]
    if used.numel() and (int(used.min()) < 0 or int(used.max()) >= num_slots):
        name = "kv_indices" if rows is None else "req_to_token"
        _fail(op, f"{name} holds slots outside the pool's [0, {num_slots})")


def check_store_kv(
    k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
    device_type: str = "cuda",
) -> None:  # fmt: skip
    """k_pool / v_pool (slots, Hkv, D), slots (n,) int32/int64, k / v (n, Hkv, D), all on one device."""
    op = "store_kv"
    if k_pool.dim() != 3:
        _fail(op, f"k_pool must be (num_slots, num_kv_heads, head_dim), got shape {list(k_pool.shape)}")
    for name, t in (("k_pool", k_pool), ("v_pool", v_pool), ("k", k), ("v", v)):
        check_tensor(op, name, t, k_pool, device_type=device_type)
        if t.dtype != k_pool.dtype:
            _fail(op, f"{name} is {dtype_name(t.dtype)} but k_pool is {dtype_name(k_pool.dtype)}")
    if v_pool.shape != k_pool.shape:
        _fail(op, f"v_pool has shape {list(v_pool.shape)} but k_pool has {list(k_pool.shape)}")
    check_index(op, "slots", slots, k_pool, dims=1, layout="(tokens,)", allow_int64=True, device_type=device_type)
    row = list(k_pool.shape[1:])
    for name, t in (("k", k), ("v", v)):
        if t.dim() != 3 or t.shape[0] != slots.shape[0] or list(t.shape[1:]) != row:
            _fail(op, f"{name} must be ({slots.shape[0]}, {row[0]}, {row[1]}), got {list(t.shape)}")
    if checking_indices() and slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= k_pool.shape[0]):
        _fail(op, f"slots must lie in [0, {k_pool.shape[0]})")
