"""Where a step's deltas go: a `RequestHandle` per submitted request, readable from any thread or event loop,
and the `Outbox` that routes each delta to its handle or to the queue `Engine.step()` returns.

A handle is filled by whoever steps the engine (its background loop, or a caller driving it) and read by
its consumer. When no loop runs, reading a handle that has nothing yet steps the engine once (`drive`).
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Iterator

from .reader import TextReader
from .request import Completion, Delta, RequestError, is_sample_of

_END, _DRIVE = object(), object()  # what `RequestHandle._look` returns when it has no delta


class RequestHandle:
    """A submitted request and its n samples: iterate (or `async for`) its deltas, or wait for `result()`.

    Safe to read from any thread. Iterating raises `RequestError` at a sample that failed in a step, and
    whatever engine-wide error ended the request; `abort()` stops it from any thread.
    """

    def __init__(self, request_id: str, engine, keep_deltas: bool = True, reader: TextReader | None = None):
        self.id, self._engine, self._keep = request_id, engine, keep_deltas
        # makes the text of the deltas as they are read, on the reader's thread (reader.py)
        self.reader = reader if reader is not None else TextReader(None, None)
        self._cond = threading.Condition()
        self._deltas: deque[Delta] = deque()  # as the step made them (their ids)
        self._texted: deque[Delta] = deque()  # read: their text made, cut at a stop string
        self._completions: list[Completion] = []
        self._error: BaseException | None = None
        self._closed = False
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []

    # -- the engine's side (under the engine's lock) --------------------------------------------------------
    def put(self, delta: Delta) -> None:
        with self._cond:
            if self._keep or delta.finish_reason is not None or delta.request_id in self.reader:
                self._deltas.append(delta)
            self.wake()

    def drop(self) -> None:
        """Forget the deltas not read yet (the request was aborted)."""
        with self._cond:
            self._deltas.clear()
            self._texted.clear()

    def close(self, completions: list[Completion], error: BaseException | None = None) -> None:
        """Every sample ended (`completions`, in index order), or an engine-wide `error` ended them."""
        with self._cond:
            if not self._closed:
                self._closed, self._completions, self._error = True, completions, error
            self.wake()

    def wake(self) -> None:
        """Make waiting readers look again (new deltas, the end, or the engine's loop stopped)."""
        with self._cond:
            self._cond.notify_all()
            for loop, future in self._waiters:
                loop.call_soon_threadsafe(_resolve, future)
            self._waiters.clear()

    # -- the consumer's side --------------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        """Whether every sample ended (some deltas may not have been read yet)."""
        with self._cond:
            return self._closed

    def abort(self) -> None:
        """Stop the request and its samples now, from any thread; deltas not read yet are dropped."""
        self._engine.abort(self.id)

    def _read_kept(self) -> None:
        """Under the reader's lock: make the text of every delta kept so far (reader.py), off the step."""
        while True:
            with self._cond:
                if not self._deltas:
                    return
                raw = self._deltas.popleft()
            delta = self.reader.read(raw)
            if delta is not None:
                self._texted.append(delta)

    def _take(self, check: bool) -> Delta | None:
        """Under the reader's lock: the next delta read, if any (RequestError at a failed sample's)."""
        try:
            delta = self._texted.popleft()
        except IndexError:  # none, or an abort dropped them
            return None
        if check and delta.finish_reason == "error":
            raise RequestError(delta.request_id, delta.completion.error)
        return delta

    def _ended(self) -> bool:
        """Under the condition: every sample ended and every delta was taken (or the error that ended them raises)."""
        if self._deltas or not self._closed:
            return False
        if self._error is not None:
            raise self._error
        return True

    def _all_kept_read(self) -> bool:
        with self._cond:
            return self._closed and not self._deltas

    def _await_more(self) -> None:
        """Until a delta is kept or the request ended: waits for the engine's loop, or steps it once."""
        with self._cond:
            if self._deltas or self._closed:
                return
            if self._engine.running:
                self._cond.wait()
                return
        self._engine.drive()

    def _look(self, check: bool, loop: asyncio.AbstractEventLoop | None = None):
        """Under the reader's lock: the next delta read, `_END` when every sample ended and was read, or `_DRIVE`
        when nothing is kept and no loop steps the engine. While the engine's loop runs and nothing is kept, waits
        on the condition and looks again, or with `loop`, returns a future that resolves when there is more."""
        while True:
            self._read_kept()
            if (delta := self._take(check)) is not None:
                return delta
            with self._cond:
                if self._ended():
                    return _END
                if self._deltas:
                    continue
                if not self._engine.running:
                    return _DRIVE
                if loop is None:
                    self._cond.wait()
                    continue
                future = loop.create_future()
                self._waiters.append((loop, future))
                return future

    def _next(self, check: bool = True) -> Delta | None:
        """The next delta, None at the end; waits for the engine's loop, or steps the engine when none runs."""
        with self.reader.lock:
            while (got := self._look(check)) is _DRIVE:
                self._engine.drive()
        return None if got is _END else got

    def __iter__(self) -> Iterator[Delta]:
        while (delta := self._next()) is not None:
            if delta.token_ids or delta.finish_reason:
                yield delta

    def wait(self) -> None:
        """Block until every sample ended (a failed sample raises nothing here; an engine-wide error does)."""
        while self._next(check=False) is not None:
            pass

    def result(self) -> list[Completion]:
        """Wait until every sample ended; their completions in index order (RequestError if one failed)."""
        self.wait()
        return self._checked_completions()

    def _checked_completions(self) -> list[Completion]:
        failed = next((c for c in self._completions if c.error is not None), None)
        if failed is not None:
            raise RequestError(failed.request_id, failed.error)
        with self.reader.lock:
            return [self.reader.fill(c) for c in self._completions]

    def __aiter__(self) -> RequestHandle:
        return self

    async def __anext__(self) -> Delta:
        loop = asyncio.get_running_loop()
        while True:
            with self.reader.lock:
                got = self._look(True, loop)
            if got is _END:
                raise StopAsyncIteration
            if got is _DRIVE:  # no loop runs: step the engine off the event loop's thread
                await asyncio.to_thread(self._engine.drive)
            elif isinstance(got, asyncio.Future):
                await got
            elif got.token_ids or got.finish_reason:
                return got

    async def result_async(self) -> list[Completion]:
        """`result()` for a coroutine: awaits the deltas instead of blocking the event loop."""
        async for _ in _ignoring_failures(self):
            pass
        return self._checked_completions()


def wait_all(handles: list[RequestHandle]) -> None:
    """Wait until every handle's request ended, reading each handle's deltas as they come rather than one handle
    after the other: a request with stop strings is cut and released one step after its stop, not left to run on
    and park until its turn to be read (reader.py)."""
    pending = list(handles)
    while pending:
        for handle in pending:
            with handle.reader.lock:
                handle._read_kept()
        pending = [h for h in pending if not h._all_kept_read()]
        if pending:
            pending[0]._await_more()


async def _ignoring_failures(handle: RequestHandle):
    while True:
        try:
            yield await handle.__anext__()
        except RequestError:
            continue
        except StopAsyncIteration:
            return


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


class Outbox:
    """Routes each delta to the handle of its request (a sample's to its parent's), or to one queue, in
    the order made, for `Engine.step()` (requests added with `add_request`, and their samples)."""

    def __init__(self):
        self.handles: dict[str, RequestHandle] = {}  # by request id, samples included
        self.stepped: set[str] = set()
        self.queue: list[Delta] = []

    def open(self, request_id: str, handle: RequestHandle | None) -> None:
        if handle is not None:
            self.handles[request_id] = handle
        else:
            self.stepped.add(request_id)

    def follow(self, parent_id: str, sample_id: str) -> None:
        """A sample goes where its parent's deltas go."""
        if parent_id in self.stepped:
            self.stepped.add(sample_id)
        elif parent_id in self.handles:
            self.handles[sample_id] = self.handles[parent_id]

    def post(self, deltas: list[Delta]) -> None:
        for delta in deltas:
            rid = delta.request_id
            if rid in self.handles:
                self.handles[rid].put(delta)
            elif rid in self.stepped:
                self.queue.append(delta)
                if delta.finish_reason is not None:
                    self.stepped.discard(rid)

    def take_stepped(self) -> list[Delta]:
        deltas, self.queue = self.queue, []
        return deltas

    def forget(self, request_id: str) -> None:
        """Drop what request `request_id` and its samples have not handed out (it was aborted)."""
        handle = self.handles.get(request_id)
        if handle is not None:
            handle.drop()
        self.stepped = {r for r in self.stepped if not is_sample_of(r, request_id)}
        self.queue = [d for d in self.queue if not is_sample_of(d.request_id, request_id)]

    def end(self, request_id: str, completions: list[Completion], error: BaseException | None = None) -> None:
        """Every sample of `request_id` ended: close its handle, stop routing its ids."""
        handle = self.handles.get(request_id)
        for rid in [r for r in (*self.handles, *self.stepped) if is_sample_of(r, request_id)]:
            self.handles.pop(rid, None)
            self.stepped.discard(rid)
        if handle is not None:
            handle.close(completions, error)

    def check(self, tracked) -> None:
        """Every open handle and step() id belongs to a request in `tracked` (ids of unfinished requests)."""
        for rid, handle in self.handles.items():
            assert not handle.done, f"the handle of {rid} is closed but still routed"
            assert any(is_sample_of(r, handle.id) for r in tracked), f"{rid}'s handle outlived its request"
        for rid in self.stepped:
            assert rid in tracked, f"step() still waits for {rid}, which ended"

    def open_handles(self) -> list[RequestHandle]:
        return list({id(h): h for h in self.handles.values()}.values())
