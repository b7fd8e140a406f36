"""What the engine does when a step fails: the step is run again one request at a time, a request that fails
alone ends with finish_reason "error" and gives its memory back, and an engine-wide error (or an interrupt)
undoes the step and propagates; when nothing can be scheduled, the head of the queue that cannot fit beside what
sessions pin is refused alone. A mixin of `Engine`, which gives it `_compute`, `_commit`, `_finish`, `_advance`
and its scheduler, pool, sessions and outbox.
"""

from __future__ import annotations

from .cache import CapacityError, InferenceError
from .request import Delta, Request


class StepRecovery:
    def _run(self, plan: list[tuple[Request, int]]) -> list[Delta]:
        """Compute and sample `plan`; when that raises, run it again one request at a time.

        An InferenceError (the engine's own, e.g. BackendUnavailable) and an interrupt concern every
        request: the step is undone and the error propagates.
        """
        before = [(req, req.num_computed, req.table_len) for req, _ in plan]
        try:
            picks = self._compute(plan)
        except BaseException as err:
            if isinstance(err, Exception) and not isinstance(err, InferenceError):
                return self._isolate(plan, before)
            self._undo(before)
            raise
        return self._commit(picks)

    def _isolate(self, plan: list[tuple[Request, int]], before) -> list[Delta]:
        """Run a failed step's requests one at a time; each that fails alone is failed and released."""
        self.runner.forget_step_state()
        _rewind(before)
        planned = {id(req) for req, _ in plan}
        forks = [r for r in self.scheduler.running if r.ready_logits is not None and id(r) not in planned]
        deltas: list[Delta] = []
        for i, (req, n) in enumerate(plan + [(clone, 0) for clone in forks]):
            if req.finished:
                continue
            try:
                picks = self._compute([(req, 0 if req.ready_logits is not None else n)])
            except Exception as alone:
                deltas.append(self._fail(req, alone))
                continue
            except BaseException:
                self._undo(before[i:])  # the requests not run yet
                raise
            deltas += self._commit(picks)
        return deltas

    def _undo(self, before: list[tuple[Request, int, int]]) -> None:
        """Undo a step that is not run again: counts rewound, the pages taken for its tokens given back."""
        self.runner.forget_step_state()
        _rewind(before)
        for req, _, _ in before:
            if not req.finished:
                keep = self.pool.pages_for(req.num_computed)
                self.pool.release(req.pages[keep:])
                req.pages = req.pages[:keep]

    def _fail(self, req: Request, err: Exception) -> Delta:
        """End `req` with finish_reason "error": its pages and row go back, the other requests go on."""
        req.error = f"{type(err).__name__}: {err}"
        req.ready_logits, req.forks_left = None, 0
        self._finish(req, "error")
        return Delta(req.id, "", [], "error", req.completion())

    def _step_or_fail(self) -> None:
        if self.scheduler.idle:
            raise InferenceError("no request is queued or running")
        if not self._advance() and not (self._read_parked() and self._advance()):  # reader.py
            pinned = sum(len(s.pages) for s in self.sessions.values())
            err = CapacityError(
                f"the request does not fit in the pool beside what sessions pin ({self.pool.usage()}; sessions "
                f"pin {pinned} pages); lower its max_tokens or n, close or expire sessions, or raise max_total_tokens"
            )
            if self.scheduler.running or not self.scheduler.waiting:
                raise err
            # nothing runs, so nothing will free memory for the head of the queue: it alone is refused, and
            # the requests behind it are served (admission keeps arrival order, so it would block them all)
            self._refuse(self.scheduler.waiting[0], err)

    def _refuse(self, req: Request, err: CapacityError) -> None:
        """End a queued request that cannot be served: its handle raises `err`, the others go on."""
        delta = self._fail(req, err)
        self._ended = [parent for parent in self._ended if parent is not req]
        if self._outbox.handles.get(req.id) is None:  # an add_request caller learns it from step()
            self._outbox.post([delta])
        self._outbox.end(req.id, [req.completion()], err)


def _rewind(before: list[tuple[Request, int, int]]) -> None:
    """Undo a failed forward: requests without fresh logits compute their tokens again."""
    for req, num_computed, table_len in before:
        if req.ready_logits is None and not req.finished:
            req.num_computed, req.table_len = num_computed, table_len
