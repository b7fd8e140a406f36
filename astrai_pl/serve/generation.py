"""One API call's generation: its prompts submitted to the engine, its handles read as they fill, and the
answer given whole or streamed as server-sent events.

    call = completion_call(body, state)                # protocol.py: prompts, SamplingParams, shapes
    return await generate(request, state, off_loop(completion_call))    # the route's whole body

Handles are read with `async for`, so the event loop never blocks and concurrent requests share the engine's
batches. A request whose client goes away — mid-stream or while waiting for a whole answer — is aborted and
its pages released; a streamed answer releases them however its response ends.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from ..inference import (
    CapacityError,
    Completion,
    Delta,
    InferenceError,
    PromptError,
    RequestError,
    RequestHandle,
    SamplingParamsError,
)
from ..jsonl import NotUtf8, UnreadableJson, decode_utf8, parse_json
from .errors import APIError, bad_request, from_sampling_error, internal_error, log
from .lora_models import route_to_adapter
from .protocol import Call, raise_for_finish
from .state import ServerState, join_salts

MAX_BODY_BYTES = 32 * 2**20
DISCONNECT_POLL_S = 0.1
STALL_TIMEOUT_S = 60.0  # a stream whose client takes none of its bytes for this long is ended


class Generation:
    """The engine requests of one API call (a handle per prompt, n samples each) and their timings."""

    def __init__(self, state: ServerState, call: Call):
        self.state, self.call, self.n = state, call, call.params.n
        self.handles = []
        self.closed = False
        self.start = time.perf_counter()
        self.first_token: float | None = None
        self.completions: list[Completion | None] = [None] * call.num_choices
        try:
            for ids in call.prompts:
                self.handles.append(self.submit(ids))
        except PromptError as err:
            self.close()
            raise bad_request(str(err), "prompt" if call.object == "text_completion" else "messages") from None
        except (CapacityError, SamplingParamsError) as err:  # the engine's own limits (n, stop ids in vocab)
            self.close()
            raise from_sampling_error(err) from None
        except BaseException:
            self.close()
            raise
        state.handles.update(self.handles)

    def submit(self, ids: list[int]) -> RequestHandle:
        """Queue one prompt's request (a session's turn queues it on its session instead)."""
        return self.state.engine.submit(ids, self.call.params)

    def close(self) -> None:
        """Abort whatever still runs, and count the tokens of what ended (once: a second call does nothing)."""
        if self.closed:
            return
        self.closed = True
        for handle in self.handles:
            if not handle.done:
                handle.abort()
            self.state.handles.discard(handle)
        done = [c for c in self.completions if c is not None]
        if done:
            cached = sum(c.cached_tokens for c in done if c.index == 0) if self.state.report_cached_tokens else 0
            self.state.metrics.tokens(sum(len(p) for p in self.call.prompts), sum(len(c.token_ids) for c in done),
                                      cached)
        self.handles = []

    def _choice(self, p: int, handle, delta: Delta) -> int:
        sample = 0 if delta.request_id == handle.id else int(delta.request_id.rpartition(".")[2])
        return p * self.n + sample

    async def events(self) -> AsyncIterator[tuple[int, Delta]]:
        """(choice index, delta) from every handle as they come; the last delta of a choice has its completion."""
        last = [0.0] * len(self.completions)
        async for index, delta in self._merged():
            now = time.perf_counter()
            if delta.token_ids:
                if self.first_token is None:
                    self.first_token = now
                    self.state.metrics.first_token(now - self.start)
                elif last[index]:
                    self.state.metrics.inter_token(now - last[index])
                last[index] = now
            if delta.completion is not None:
                self.completions[index] = delta.completion
            yield index, delta
        for index, delta in self._unannounced():
            yield index, delta

    def _unannounced(self) -> list[tuple[int, Delta]]:
        """A final delta for each sample that ended without one (max_tokens=0: prefill only), taken from its
        closed handle; an aborted sample's completion is kept, for `raise_for_finish`, but not announced."""
        ended = []
        for p, handle in enumerate(self.handles):
            if not handle.done:
                continue
            for c in handle.result():  # closed: returns at once
                index = p * self.n + c.index
                if self.completions[index] is None:
                    self.completions[index] = c
                    if c.finish_reason != "abort":
                        ended.append((index, Delta(c.request_id, "", [], c.finish_reason, c)))
        return ended

    async def _merged(self) -> AsyncIterator[tuple[int, Delta]]:
        if len(self.handles) == 1:
            async for delta in self.handles[0]:
                yield self._choice(0, self.handles[0], delta), delta
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(p: int, handle) -> None:
            try:
                async for delta in handle:
                    queue.put_nowait((self._choice(p, handle, delta), delta))
            except BaseException as err:  # handed to the reader, which raises it
                queue.put_nowait(err)
            finally:
                queue.put_nowait(None)

        tasks = [asyncio.ensure_future(pump(p, h)) for p, h in enumerate(self.handles)]
        try:
            running = len(tasks)
            while running:
                item = await queue.get()
                if item is None:
                    running -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()

    async def collect(self) -> list[Completion]:
        async for _ in self.events():
            pass
        raise_for_finish(self.completions)
        return self.completions


def _engine_error(err: Exception) -> APIError:
    if isinstance(err, RequestError):
        return APIError(500, f"generation failed: {err.error}", type="server_error")
    return APIError(503, f"the engine could not serve the request: {err}", type="server_error")


async def _client_gone(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)


async def answer_whole(request: Request, generation: Generation) -> dict:
    """The whole answer, or the requests aborted as soon as the client disconnects."""
    work = asyncio.ensure_future(generation.collect())
    watch = asyncio.ensure_future(_client_gone(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            generation.close()
            work.cancel()
    if not work.done() or work.cancelled():
        raise APIError(499, "the client disconnected", code="client_closed_request")
    try:
        return generation.call.response(work.result())
    except InferenceError as err:
        raise _engine_error(err) from None


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


async def event_stream(generation: Generation) -> AsyncIterator[str]:
    """Server-sent events: the chunks, the usage chunk when asked, an error chunk if it failed, [DONE]."""
    call = generation.call
    for chunk in call.opening_chunks():
        yield _sse(chunk)
    try:
        async for index, delta in generation.events():
            for chunk in call.chunks(index, delta):
                yield _sse(chunk)
        raise_for_finish(generation.completions)
        if call.include_usage:
            yield _sse(call.usage_chunk(generation.completions))
    except APIError as err:
        yield _sse(err.body())
    except InferenceError as err:
        yield _sse(_engine_error(err).body())
    except Exception as err:  # a bug: the client still gets an error event and the stream's end
        yield _sse(json.loads(internal_error(err).body))
    yield "data: [DONE]\n\n"


class ClientStalled(Exception):
    """A stream's client kept its connection open but stopped reading for STALL_TIMEOUT_S."""


class EventStream(StreamingResponse):
    """A streamed answer that releases its requests however it ends: finished, failed, the client gone
    before or during the stream (a generator that never ran has no `finally` of its own), or the client
    stalled: a reader that takes no bytes would otherwise hold its --max-queue slot (and a session's turn)
    for as long as it keeps the connection open."""

    def __init__(self, state: ServerState, generation: Generation):
        super().__init__(event_stream(generation), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.state, self.generation = state, generation

    async def __call__(self, scope, receive, send) -> None:
        async def send_or_stall(message) -> None:
            try:
                await asyncio.wait_for(send(message), STALL_TIMEOUT_S)
            except asyncio.TimeoutError:
                raise ClientStalled from None

        try:
            await super().__call__(scope, receive, send_or_stall)
        except ClientStalled:  # the server closes the connection of a response it did not finish
            log.warning("a stream's client read nothing for %s s; its request was aborted", STALL_TIMEOUT_S)
        finally:
            await self.body_iterator.aclose()
            self.generation.close()
            self.state.release()


async def read_bytes(request: Request, limit: int | None = None, what: str = "the request body") -> bytes:
    """The body; read no further than `limit` (default MAX_BODY_BYTES; 413 beyond)."""
    limit = MAX_BODY_BYTES if limit is None else limit
    raw = bytearray()
    try:
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > limit:
                raise APIError(413, f"{what} is over {limit} bytes, the most the server reads",
                               code="request_too_large")
    except ClientDisconnect:  # gone before the body was whole: nothing to answer, nothing went wrong here
        raise APIError(499, "the client disconnected", code="client_closed_request") from None
    return bytes(raw)


async def read_json(request: Request) -> dict:
    """The body as a JSON object; read no further than MAX_BODY_BYTES (413 beyond)."""
    raw = await read_bytes(request)
    try:
        text = decode_utf8(raw)
        body = parse_json(text)
    except (NotUtf8, UnreadableJson) as err:
        raise bad_request(f"the request body is not valid JSON ({err}); send a JSON object") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    if _SURROGATE_ESCAPE.search(text) and (where := _lone_surrogate(body)) is not False:
        raise bad_request(f"{f'{where!r}' if where else 'the request body'} holds a lone UTF-16 surrogate escape "
                          "(\\ud800-\\udfff without its pair), which is no character; send valid Unicode", where)
    return body


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # how a lone surrogate gets into parsed JSON


def _lone_surrogate(body: dict) -> str | None | bool:
    """The path of the first string in `body` not encodable as UTF-8 (None: a key of the body itself), else
    False: such a string fails in the tokenizer and in every response that quotes it."""
    todo: list[tuple[str | None, object]] = [(None, body)]
    while todo:  # iterative: the body may nest as deep as the JSON parser allows
        path, value = todo.pop()
        if isinstance(value, str) and not _encodable(value):
            return path
        if isinstance(value, dict):
            if not all(_encodable(key) for key in value):  # the path names the object, not the key
                return path
            todo += [(f"{path}.{k}" if path else k, v) for k, v in value.items()]
        elif isinstance(value, list):
            todo += [(f"{path}[{i}]", v) for i, v in enumerate(value)]
    return False


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def off_loop(parse):
    """`parse(raw, state)` as a coroutine running it on the server's tokenizing threads (`state.off_loop`):
    tokenizing a long text takes a while, which the event loop, and so every other request, would otherwise
    wait for."""

    async def parsed(raw: dict, state: ServerState) -> Call:
        return await state.off_loop(parse, raw, state)

    return parsed


async def generate(request: Request, state: ServerState, parse, start=Generation) -> Response:
    """Parse the body into a Call (`parse`: a coroutine function, e.g. `off_loop(completion_call)`), submit it
    (`start`: a Generation or a session's turn) and answer."""
    raw = await read_json(request)
    call = await parse(raw, state)
    route_to_adapter(state, call, raw)
    if not call.salted:  # a session's turn carries its session's salt
        call.params.cache_salt = join_salts(getattr(request.state, "key_salt", None), call.params.cache_salt)
    state.admit()
    try:
        generation = start(state, call)
    except BaseException:
        state.release()
        raise
    if call.stream:
        return EventStream(state, generation)  # it releases the generation and the slot
    try:
        return JSONResponse(await answer_whole(request, generation))
    finally:
        generation.close()
        state.release()
