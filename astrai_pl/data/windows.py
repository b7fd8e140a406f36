"""Tagging each training micro-batch with the size of its accumulation window (exact accumulation).

Lightning steps the optimizer every `accumulate_grad_batches` (K) micro-batches of an epoch and once
more on the epoch's last batch, and divides every micro-batch loss by K — also in a short last window.
A token-mean loss averaged that way is a mean of per-micro-batch means, and a short window is scaled
by a K it does not have. `WindowedLoader` reads a whole window ahead and adds to each of its batches
the count of the window (by default `window_tokens`: the trained next-token targets of all its
micro-batches, the short last window counted by its real size), so an objective can normalise by it
(see `Objective.accumulation_scale`) and make the accumulated gradient the exact mean over the window.

Windows follow Lightning's step boundaries: they start at batch 0 of every epoch, K batches each, and
stop at the trainer's `num_training_batches` (which `limit_train_batches` may cut short). The wrapper
is sized when the inner loader is, so Lightning does not read a batch ahead of it. When the inner
loader is stateful (`state_dict` / `load_state_dict`), the wrapper is too: its state is the inner
state at the start of the current window, the window's position in the epoch, and how many batches of
it were already handed out — so a restored run re-reads that window, counts it the same, and goes on
where it stopped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from .packing import IGNORE_INDEX

Counter = Callable[[dict[str, Any]], int]


def trained_targets_in(batch: dict[str, Any]) -> int:
    """Next-token targets that train in a batch: labels[:, 1:] that are not -100 (labels are unshifted)."""
    return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())


def pairs_in(batch: dict[str, Any]) -> int:
    """Preference pairs in a batch (rows of `chosen_input_ids`)."""
    return int(batch["chosen_input_ids"].shape[0])


def chosen_tokens_in(batch: dict[str, Any]) -> int:
    """Scored tokens of a batch's chosen responses (at least one each), as DPO and ORPO count them."""
    return int((batch["chosen_labels"][:, 1:] != IGNORE_INDEX).sum(1).clamp(min=1).sum())


class WindowedLoader:
    """An iterable over `loader`'s batches (dicts), each with `batch[key]` = `count` summed over its window, and
    likewise each counter of `also` under its own key (e.g. DPO's pairs and chosen tokens).

    `accumulate` and `limit` are read at the start of every epoch, so they can come from a trainer that
    is configured after the loader is built: K = accumulate(), batches per epoch = limit() (None or
    inf: until the loader is exhausted).
    """

    def __init__(
        self,
        loader: Iterable[dict[str, Any]],
        accumulate: Callable[[], int],
        limit: Callable[[], float | None] = lambda: None,
        count: Counter = trained_targets_in,
        key: str = "window_tokens",
        also: dict[str, Counter] | None = None,
    ):
        self.loader, self.accumulate, self.limit = loader, accumulate, limit
        self.counters = {key: count, **(also or {})}
        self._start = 0  # position in the epoch of the next window to read
        self._skip = 0  # batches of that window already handed out before a restore

    def __len__(self) -> int:
        return len(self.loader)  # TypeError for an unsized loader, as len() of it would raise

    def __getattr__(self, name: str) -> Any:
        # `dataset`, `sampler`, `batch_sampler`, `batch_size`: Lightning sets sampler epochs through them.
        if name in ("loader", "state_dict", "load_state_dict") or name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        k = int(self.accumulate())
        if k < 1:
            raise ValueError(f"accumulate_grad_batches={k}; must be >= 1")
        limit = self._epoch_length()
        start, skip = self._start, self._skip
        self._start = self._skip = 0  # a restored position applies to one iteration only
        if limit is not None and start >= limit:  # restored at the end of an epoch: a new one begins
            start = skip = 0
        inner = iter(self.loader)
        while limit is None or start < limit:
            self._begin_window(start)
            size = k if limit is None else int(min(k, limit - start))
            window = _take(inner, size)
            if not window:
                return
            totals = {key: sum(count(batch) for batch in window) for key, count in self.counters.items()}
            self._window_len = len(window)
            for i, batch in enumerate(window):
                if i >= skip:
                    self._handed = i + 1
                    yield {**batch, **totals}
            start, skip = start + len(window), 0
            if len(window) < size:
                return

    def _epoch_length(self) -> float | None:
        """Batches Lightning draws this epoch: the trainer's limit, else the loader's length, else None."""
        limit = self.limit()
        try:
            size = len(self.loader)
        except (TypeError, NotImplementedError):
            return limit
        return size if limit is None else min(limit, size)

    def _begin_window(self, start: int) -> None:
        self._window_start, self._window_len, self._handed = start, 0, 0


def _take(iterator: Iterator[Any], n: int) -> list[Any]:
    out = []
    for _ in range(n):
        try:
            out.append(next(iterator))
        except StopIteration:
            break
    return out


class StatefulWindowedLoader(WindowedLoader):
    """A WindowedLoader over a stateful loader; Lightning saves its state in checkpoints."""

    def _begin_window(self, start: int) -> None:
        super()._begin_window(start)
        self._inner_state = self.loader.state_dict()

    def state_dict(self) -> dict[str, Any]:
        if not hasattr(self, "_inner_state"):  # not iterated yet: the inner loader's own state
            return {"inner": self.loader.state_dict(), "start": self._start, "skip": self._skip}
        if self._handed == self._window_len:  # between windows: nothing read ahead
            end = self._window_start + self._window_len
            return {"inner": self.loader.state_dict(), "start": end, "skip": 0}
        return {"inner": self._inner_state, "start": self._window_start, "skip": self._handed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state["inner"])
        self._start, self._skip = state["start"], state["skip"]


def windowed(
    loader: Iterable[dict[str, Any]],
    trainer: Any,
    count: Counter = trained_targets_in,
    key: str = "window_tokens",
    also: dict[str, Counter] | None = None,
) -> Iterable[dict[str, Any]]:
    """`loader` tagged per accumulation window of `trainer` (stateful when the loader is) with `count` under
    `key` and each counter of `also` under its key; the loader itself when there is no trainer."""
    if trainer is None:
        return loader
    cls = (
        StatefulWindowedLoader
        if hasattr(loader, "state_dict") and hasattr(loader, "load_state_dict")
        else WindowedLoader
    )
    return cls(
        loader, lambda: trainer.accumulate_grad_batches, lambda: _batches_per_epoch(trainer), count, key, also
    )


def _batches_per_epoch(trainer: Any) -> float | None:
    n = getattr(trainer, "num_training_batches", None)
    return None if n is None or n == float("inf") else n
