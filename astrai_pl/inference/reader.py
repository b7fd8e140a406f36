"""A request's text, made by whoever reads it rather than by the engine's step.

The step only appends sampled ids (and log-probs) to its requests and hands them on as deltas. A
`TextReader` — one per `RequestHandle`, and one for `Engine.step()`'s caller — turns those ids into text
deltas on the reader's thread, with the same `TextStream` the step used to run, so the deltas and the final
text are what they were. A stop string is found there too: the reader cuts the delta at the id that completed
it and tells the engine (`settle`), which ends the request at once under its lock: the ids made after the stop
are dropped (not returned, not counted), the K/V pages past it go back, and neither the prefix cache nor a
session's history sees anything past it.

Since the engine cannot know whether the text holds a stop string, a request with stop strings that reaches
its own end (an end id, max_tokens, the context) is parked rather than released: it leaves the batch, keeps
its pages, and is released when its reader has read its last ids (`settle(…, None)`). A request with no stop
string that nobody reads as it runs (`generate`, rollouts) keeps the single decode at its end, in the step
(`TextStream.add`). Recurrent models keep stop strings in the step: their state cannot be rolled back past one.

Locks: a reader holds its own lock while it reads and settles; `settle` then takes the engine's lock, which
the engine never holds while waiting for a reader, so the two never wait on each other.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace

from .request import Completion, Delta, Request
from .sampling import SamplingParams
from .text import TextStream

Settle = Callable[[str, "int | None"], "Completion | None"]


class _Sample:
    def __init__(self, stream: TextStream):
        self.stream, self.seen, self.done = stream, 0, False  # seen: output ids read so far


class TextReader:
    """Text deltas of the samples it tracks, from the raw deltas of the step (ids only); others pass through."""

    def __init__(self, tokenizer, settle: Settle):
        self.tokenizer, self._settle = tokenizer, settle
        self.lock = threading.Lock()  # held while reading: deltas of one sample are read in order
        self._samples: dict[str, _Sample] = {}

    def track(self, sample_id: str, params: SamplingParams) -> None:
        """Read `sample_id`'s text here (the engine calls this, under its lock, when it queues or forks it)."""
        stream = TextStream(self.tokenizer, params.stop, params.skip_special_tokens)
        self._samples[sample_id] = _Sample(stream)

    def __contains__(self, sample_id: str) -> bool:
        return sample_id in self._samples

    def read(self, delta: Delta) -> Delta | None:
        """`delta` with its text, cut at a stop string; None when it comes after the sample's end."""
        s = self._samples.get(delta.request_id)
        if s is None:
            return delta
        if s.done:
            return None  # ids made after a stop string, before the engine ended the request
        reason = delta.finish_reason
        if reason in ("error", "abort"):
            s.done = True
            return replace(delta, completion=self.fill(delta.completion))
        end = 1 if reason == "stop" else 0  # an end id: kept in token_ids, left out of the text
        text = ""
        for i, token in enumerate(delta.token_ids[: len(delta.token_ids) - end]):
            s.seen += 1
            text += s.stream.push(token)
            if s.stream.stopped:
                return self._stopped(delta, s, text, i + 1)
        s.seen += end
        if reason is None:
            return replace(delta, text=text)
        text += s.stream.finish()
        s.done = True
        completion = delta.completion
        if completion is None:  # parked: it ends now that its text holds no stop string
            completion = self._settle(delta.request_id, None)
            if completion is None:
                return None  # aborted meanwhile
        return replace(delta, text=text, completion=self.fill(completion))

    def _stopped(self, delta: Delta, s: _Sample, text: str, keep: int) -> Delta | None:
        """The sample's last delta: its ids up to the one that completed a stop string."""
        s.done = True
        text += s.stream.finish()
        completion = self._settle(delta.request_id, s.seen)
        if completion is None:
            return None  # aborted meanwhile
        return Delta(
            delta.request_id, text, delta.token_ids[:keep], "stop", self.fill(completion),
            _cut(delta.logprobs, keep), _cut(delta.top_logprobs, keep), delta.prompt_logprobs,
        )  # fmt: skip

    def fill(self, completion: Completion | None) -> Completion | None:
        """A completion of a tracked sample with its text (an aborted or failed one's: its ids' text so far)."""
        s = None if completion is None else self._samples.get(completion.request_id)
        if s is None:
            return completion
        if completion.finish_reason in ("abort", "error"):
            for token in completion.token_ids[s.seen :]:  # ids its reader had not read
                if s.stream.stopped:
                    break
                s.seen += 1
                s.stream.push(token)
        return replace(completion, text=s.stream.text)


def _cut(values: list | None, keep: int) -> list | None:
    return None if values is None else values[:keep]


class ReaderSteps:
    """The engine's side of reading: which requests are read outside the step, parking those with stop
    strings at their end, and settling them when their reader has read their text. A mixin of `Engine`,
    which gives it `lock`, `tokenizer`, `model`, `pool`, `scheduler`, `_requests`, `_outbox`, `_finish`
    and `_close_ended`."""

    def _reads_text(self, req: Request) -> bool:
        """Whether `req`'s text is made by its reader (a stream, a step() caller, or stop strings to find)."""
        if self.tokenizer is None or req.defer_text:
            return False
        return not (req.params.stop and self._recurrent)  # a recurrent state cannot be cut back to a stop

    def _reader_of(self, request_id: str) -> TextReader:
        handle = self._outbox.handles.get(request_id)
        return handle.reader if handle is not None else self._step_reader

    def _read_outside(self, req: Request) -> None:
        """Hand `req`'s text to its reader when it should be made there: the step then decodes nothing of it."""
        if self._reads_text(req):
            req.stream, req.awaits_reader = None, bool(req.params.stop)
            self._reader_of(req.id).track(req.id, req.params)

    def _park(self, req: Request, reason: str) -> None:
        """`req` reached its own end but its text may hold a stop string: out of the batch, its pages kept."""
        req.parked = reason
        self.scheduler.remove(req)
        if req.row is not None:
            self.pool.req_to_token.free(req.row)
            req.row = None

    def _settle(self, sample_id: str, keep: int | None) -> Completion | None:
        """End a request its reader has read: at the stop string ending its first `keep` output ids, or, with
        `keep` None, where it parked. Its completion; None if it ended otherwise meanwhile (an abort)."""
        with self.lock:
            req = self._requests.get(sample_id)
            if req is None:
                return None
            if keep is not None:
                self._cut_at(req, keep)
            assert req.parked is not None or keep is not None, f"{sample_id} settled before it ended"
            self._outbox.stepped.discard(sample_id)
            self._finish(req, "stop" if keep is not None else req.parked)
            completion = req.completion()
            self._close_ended()
            return completion

    def _cut_at(self, req: Request, keep: int) -> None:
        """Drop what `req` made after its first `keep` output ids: the ids, their log-probs, their K/V and the
        pages past it, as if it had ended there (the last id's K/V was not computed then either)."""
        self.scheduler.remove(req)
        del req.tokens[req.num_prompt + keep :]
        del req.logprobs[keep:], req.top_logprobs[keep:]
        req.num_computed = min(req.num_computed, len(req.tokens) - 1)
        req.ready_logits, req.draft = None, []
        self.scheduler.trim(req, req.num_computed)

    def _read_parked(self) -> bool:
        """Memory is short and parked requests hold some: read their text here, on the engine's thread, for
        the readers that are not reading now (a caller waiting on another handle). Whether one was released."""
        released = False
        for req in self._parked():
            handle = self._outbox.handles.get(req.id)
            if handle is not None and handle.reader.lock.acquire(blocking=False):
                try:
                    handle._read_kept()
                finally:
                    handle.reader.lock.release()
                released |= req.finished
        return released

    def _parked(self) -> list[Request]:
        return [r for r in self._requests.values() if r.parked is not None]
