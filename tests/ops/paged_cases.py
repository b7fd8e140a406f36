"""Random paged-attention inputs shared by the CPU and CUDA tests: a pool with scattered slots."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PagedCase:
    q: torch.Tensor  # (T, Hq, D)
    k_pool: torch.Tensor  # (S, Hkv, D)
    v_pool: torch.Tensor
    qo_indptr: torch.Tensor  # (B+1,) int32
    kv_indptr: torch.Tensor  # (B+1,) int32
    kv_indices: torch.Tensor  # (sum kv_lens,) int64
    req_to_token: torch.Tensor  # (R, max_context) int32
    rows: torch.Tensor  # (B,) int64

    @property
    def num_requests(self) -> int:
        return self.kv_indptr.numel() - 1


def indptr(lengths: list[int], device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def paged_case(
    q_lens: list[int],
    kv_lens: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> PagedCase:
    """Contexts of kv_lens tokens at random, non-contiguous slots of a pool twice as large as needed."""
    g = torch.Generator().manual_seed(seed)
    total = sum(kv_lens)
    num_slots = 2 * total + 5
    slots = torch.randperm(num_slots, generator=g)[:total]
    num_rows = len(kv_lens) + 3
    rows = torch.randperm(num_rows, generator=g)[: len(kv_lens)]
    table = torch.zeros(num_rows, max(kv_lens) + 4, dtype=torch.int32)
    start = 0
    for row, n in zip(rows.tolist(), kv_lens):
        table[row, :n] = slots[start : start + n].to(torch.int32)
        start += n

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype).to(device)

    return PagedCase(
        q=rand(sum(q_lens), num_q_heads, head_dim),
        k_pool=rand(num_slots, num_kv_heads, head_dim),
        v_pool=rand(num_slots, num_kv_heads, head_dim),
        qo_indptr=indptr(q_lens, device),
        kv_indptr=indptr(kv_lens, device),
        kv_indices=slots.to(device),
        req_to_token=table.to(device),
        rows=rows.to(device),
    )


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out − ref| / max |ref|; infinite when out has a NaN or an infinity."""
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30))
