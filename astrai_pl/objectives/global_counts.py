"""Counts summed over the data-parallel ranks, so that a loss normalised by them is the loss of one batch.

DDP and FSDP2 average the gradients of the W data-parallel ranks. When rank r normalises its summed loss
S_r by its own count n_r, the average (1/W) Σ_r S_r / n_r is a mean of per-rank means: with uneven counts
(variable-length rows, a short last batch) it is not Σ_r S_r / Σ_r n_r, the loss one process would have on
every rank's batch together. Normalising by N / W instead, N = Σ_r n_r, makes the average exact:

    (1/W) Σ_r S_r / (N / W) = Σ_r S_r / N

With gradient accumulation over K micro-batches (Lightning divides each micro-batch loss by K), n_r is the
count of the rank's whole window and the normaliser N / (K · W): see `Objective.accumulation_scale`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def data_parallel_group(trainer: Any) -> Any:
    """The process group whose ranks average gradients: the `data_parallel` dimension of the device mesh under
    FSDP2 / tensor parallel (tensor-parallel ranks share one batch), else the default group (DDP)."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    strategy = getattr(trainer, "strategy", None) if trainer is not None else None
    if isinstance(strategy, ModelParallelStrategy) and getattr(strategy, "_device_mesh", None) is not None:
        return strategy.device_mesh["data_parallel"].get_group()
    return None


def summed_over_ranks(count: torch.Tensor, trainer: Any = None) -> tuple[torch.Tensor, int]:
    """(Σ over the data-parallel ranks of `count`, their number W); (count, 1) without torch.distributed.
    A collective: every data-parallel rank must call it at the same step."""
    if not (dist.is_available() and dist.is_initialized()):
        return count, 1
    group = data_parallel_group(trainer)
    ranks = dist.get_world_size(group)
    if ranks == 1:
        return count, 1
    total = count.detach().to(torch.int64 if not count.is_floating_point() else torch.float64).clone()
    dist.all_reduce(total, group=group)
    return total, ranks


def rank_share(count: float | int | torch.Tensor, device: torch.device, trainer: Any = None) -> torch.Tensor:
    """W · n / N: the factor that turns this rank's mean over its n items into its share of the mean over every
    rank's N items (DDP then averages the W shares). 1 on one process, and whenever the counts are equal."""
    n = torch.as_tensor(count, device=device)
    total, ranks = summed_over_ranks(n, trainer)
    return n.float() * ranks / total.float().clamp(min=1)
