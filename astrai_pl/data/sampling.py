"""Resumable batch order: a seeded, rank-sharded plan of index batches, and a loader whose position
travels in the checkpoint so that a resumed run trains on exactly the batches the interrupted one would have.

A *plan* maps an epoch number to this rank's batches (lists of dataset indices). `shuffled_batches` is
the default; a data module with its own batching (length grouping, token budgets) passes its own plan
to `StatefulLoader` and gets resumption for free.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any

import numpy as np
from torch.utils.data import DataLoader

BatchPlan = Callable[[int], Sequence[Sequence[int]]]  # epoch -> this rank's batches of dataset indices


class ResumeMismatchError(ValueError):
    """A checkpoint's loader position does not fit the data this run was given."""


def shuffled_batches(
    num_items: int,
    batch_size: int,
    epoch: int,
    *,
    seed: int = 0,
    shuffle: bool = True,
    drop_last: bool = True,
    rank: int = 0,
    world_size: int = 1,
) -> list[list[int]]:
    """This rank's batches for one epoch.

    The items are permuted with a generator seeded by (seed, epoch) and cut into global batches of
    batch_size · world_size; rank r takes the r-th slice of each. So W processes with batch_size B train
    on the same samples per optimizer step as one process with batch_size B·W. Without drop_last the
    order is padded by wrapping around, so every rank gets the same number of batches (the last smaller).
    """
    if batch_size < 1 or world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(
            f"shuffled_batches: batch_size={batch_size}, rank={rank}, world_size={world_size}: "
            "need batch_size >= 1 and 0 <= rank < world_size"
        )
    order = np.random.default_rng([seed, epoch]).permutation(num_items) if shuffle else np.arange(num_items)
    per_step = batch_size * world_size
    if drop_last:
        order = order[: len(order) // per_step * per_step]
    elif len(order) % world_size:
        order = np.resize(order, len(order) + world_size - len(order) % world_size)
    batches = []
    for start in range(0, len(order), per_step):
        chunk = order[start : start + per_step]
        share = len(chunk) // world_size
        batches.append(chunk[rank * share : (rank + 1) * share].tolist())
    return batches


def data_parallel_rank(trainer: Any) -> tuple[int, int]:
    """(rank, number of replicas) among data-parallel processes; tensor-parallel peers share a rank."""
    kwargs = getattr(getattr(trainer, "strategy", None), "distributed_sampler_kwargs", None) or {}
    return int(kwargs.get("rank", 0)), int(kwargs.get("num_replicas", 1))


def resumable_loader(
    dataset: Any, batch_size: int, seed: int, trainer: Any, collate_fn: Callable[[list], Any], *, num_workers: int = 0
) -> StatefulLoader:
    """A data module's train loader: `dataset` shuffled by seed and epoch, split over the trainer's
    data-parallel ranks (the last batch smaller, none dropped), its position saved in checkpoints."""
    rank, replicas = data_parallel_rank(trainer)
    plan = partial(shuffled_batches, len(dataset), batch_size, seed=seed, drop_last=False, rank=rank,
                   world_size=replicas)
    return StatefulLoader(dataset, plan, collate_fn, num_workers=num_workers)


class StatefulLoader:
    """Yields `collate_fn([dataset[i] for i in batch])` for each batch of `plan(epoch)`, epoch after epoch.

    `state_dict()` holds the epoch and how many of its batches have been handed out; `load_state_dict()`
    makes the next iteration start right after them. Lightning stores the state in every checkpoint (it
    saves any train loader that has these two methods) and restores it on resume. The count is exact
    because Lightning does not fetch ahead from a loader that has a length: when a checkpoint is written
    after a batch, every batch handed out has been trained. (With `limit_train_batches`, a checkpoint
    written at the last batch of a cut-short epoch resumes inside that epoch, not at the next one.)
    """

    def __init__(
        self, dataset: Any, plan: BatchPlan, collate_fn: Callable[[list], Any], *, num_workers: int = 0
    ):
        self.dataset, self.plan, self.collate_fn, self.num_workers = dataset, plan, collate_fn, num_workers
        self.epoch = 0
        self.position = 0  # batches of `epoch` handed out, counting those skipped on resume
        self._fresh = True  # no iteration of `epoch` has begun yet
        self._cache: tuple[int, Sequence[Sequence[int]]] | None = None

    def batches(self, epoch: int) -> Sequence[Sequence[int]]:
        if self._cache is None or self._cache[0] != epoch:
            self._cache = (epoch, self.plan(epoch))
        return self._cache[1]

    def __len__(self) -> int:
        return len(self.batches(self.epoch))

    def __iter__(self) -> Iterator[Any]:
        return (
            self._run()
        )  # the bookkeeping waits for the first next(): Lightning calls iter() once just to check

    def _run(self) -> Iterator[Any]:
        if not self._fresh or self.position >= len(self):  # a new pass after one that began: the next epoch
            self.epoch, self.position = self.epoch + 1, 0
        self._fresh = False
        remaining = list(self.batches(self.epoch))[self.position :]
        loader = DataLoader(
            self.dataset, batch_sampler=remaining, collate_fn=self.collate_fn, num_workers=self.num_workers
        )
        for batch in loader:
            self.position += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        if self.position >= len(self):  # the epoch is complete: resume at the start of the next one
            return {"epoch": self.epoch + 1, "batches": 0, "num_batches": len(self.batches(self.epoch + 1))}
        return {"epoch": self.epoch, "batches": self.position, "num_batches": len(self)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        epoch, consumed = int(state["epoch"]), int(state["batches"])
        expected = len(self.batches(epoch))
        if state.get("num_batches", expected) != expected or consumed > expected:
            raise ResumeMismatchError(
                f"the checkpoint's data loader had {state.get('num_batches')} batches per epoch on this rank "
                f"(position {consumed}), this run has {expected}: the data, batch_size, seed or number of "
                "data-parallel processes changed. Resume with the settings of the interrupted run, or start "
                "a new run from its weights (model.init_args.init_from)."
            )
        self.epoch, self.position, self._fresh = epoch, consumed, True
