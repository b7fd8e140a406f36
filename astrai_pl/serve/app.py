"""The FastAPI app: OpenAI's /v1 routes, /health and /metrics over a `ServerState`.

    app = create_app(ServerState(engine, tokenizer, "my-model"))
    uvicorn.run(app)                                   # or `astrai-pl serve --model DIR`

Each generation request submits its prompts to the engine (thread-safe) and reads the handles with
`async for`, so the event loop never blocks and concurrent requests share the engine's batches. A request
whose client goes away — mid-stream or while waiting for a whole answer — is aborted, its pages released.
The sessions routes come from serve/sessions_api.py: `sessions_router(state) -> APIRouter`, included here
when that module is present.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Match

from ..inference import (
    CapacityError,
    Completion,
    Delta,
    InferenceError,
    PromptError,
    RequestError,
    RequestHandle,
)
from ..jsonl import NotUtf8, UnreadableJson, decode_utf8, parse_json
from .errors import APIError, bad_request, error_body, install_error_handlers, internal_error
from .protocol import Call, chat_call, completion_call, raise_for_finish
from .state import ServerState

MAX_BODY_BYTES = 32 * 2**20
DISCONNECT_POLL_S = 0.1
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


class Generation:
    """The engine requests of one API call (a handle per prompt, n samples each) and their timings."""

    def __init__(self, state: ServerState, call: Call):
        self.state, self.call, self.n = state, call, call.params.n
        self.handles = []
        self.start = time.perf_counter()
        self.first_token: float | None = None
        self.completions: list[Completion | None] = [None] * call.num_choices
        try:
            for ids in call.prompts:
                self.handles.append(self.submit(ids))
        except PromptError as err:
            self.close()
            raise bad_request(str(err), "prompt" if call.object == "text_completion" else "messages") from None
        except CapacityError as err:
            self.close()
            raise bad_request(str(err)) from None
        except BaseException:
            self.close()
            raise
        state.handles.update(self.handles)

    def submit(self, ids: list[int]) -> RequestHandle:
        """Queue one prompt's request (a session's turn queues it on its session instead)."""
        return self.state.engine.submit(ids, self.call.params)

    def close(self) -> None:
        """Abort whatever still runs, and count the tokens of what ended."""
        for handle in self.handles:
            if not handle.done:
                handle.abort()
            self.state.handles.discard(handle)
        done = [c for c in self.completions if c is not None]
        if done:
            self.state.metrics.tokens(sum(len(p) for p in self.call.prompts), sum(len(c.token_ids) for c in done),
                                      sum(c.cached_tokens for c in done if c.index == 0))
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
    yield "data: [DONE]\n\n"


class EventStream(StreamingResponse):
    """A streamed answer that releases its requests however it ends: finished, failed, or the client gone
    before or during the stream (a generator that never ran has no `finally` of its own)."""

    def __init__(self, state: ServerState, generation: Generation):
        super().__init__(event_stream(generation), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.state, self.generation = state, generation

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            self.generation.close()
            self.state.release()


async def read_json(request: Request) -> dict:
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise APIError(413, f"the request body has {len(raw)} bytes, the server takes at most {MAX_BODY_BYTES}")
    try:
        body = parse_json(decode_utf8(raw))
    except (NotUtf8, UnreadableJson) as err:
        raise bad_request(f"the request body is not valid JSON ({err}); send a JSON object") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


async def generate(request: Request, state: ServerState, parse, start=Generation) -> Response:
    """Parse the body into a Call, submit it (`start`: a Generation or a session's turn) and answer."""
    call = parse(await read_json(request), state)
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


class MetricsMiddleware:
    """Counts every HTTP request by route and status (a stream counts as finished when it ends), and answers
    an exception no handler took with a 500 in OpenAI's shape instead of dropping the connection."""

    def __init__(self, app, state: ServerState, routes: list):
        self.app, self.state, self.routes = app, state, routes

    def route_of(self, scope) -> str:
        """The path template of the route `scope` goes to ("/v1/sessions/{id}"), or "other": few label values."""
        for route in self.routes:
            if route.matches(scope)[0] != Match.NONE:  # PARTIAL: the path matches, the method does not
                return route.path
        return "other"

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route = self.route_of(scope)
        status: int | None = None  # set once the response starts

        async def sending(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        self.state.metrics.request_started(route)
        try:
            await self.app(scope, receive, sending)
        except Exception as err:
            if status is not None:  # the response had started: nothing left to tell the client
                raise
            await internal_error(err)(scope, receive, sending)
        finally:
            self.state.metrics.request_finished(route, 500 if status is None else status)


def create_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        state.abort_all()  # what the graceful period did not finish
        state.engine.stop()

    app = FastAPI(title="astrai_pl", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = state
    install_error_handlers(app)
    labelled: list = []  # every route, for the metrics' route labels (filled below)
    app.add_middleware(MetricsMiddleware, state=state, routes=labelled)

    async def authorized(request: Request) -> None:
        state.check_key(request.headers.get("authorization"))

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorized)])

    @v1.get("/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.created,
                                            "owned_by": "astrai_pl", "max_model_len": state.context_len}]}

    @v1.post("/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, state, completion_call)

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, state, chat_call)

    app.include_router(v1)
    routers = [v1]
    try:
        from .sessions_api import sessions_router
    except ModuleNotFoundError as err:  # not there yet: the server runs without the /v1/sessions routes
        if err.name != f"{__package__}.sessions_api":
            raise
    else:
        routers.append(sessions_router(state))
        app.include_router(routers[-1], dependencies=[Depends(authorized)])

    @app.get("/health")
    async def health() -> Response:
        if state.engine.running:
            return JSONResponse({"status": "ok"})
        return JSONResponse(error_body("the engine loop is not running", "server_error"), status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=PROMETHEUS_TEXT)

    labelled += [r for router in (*routers, app.router) for r in router.routes if hasattr(r, "path")]
    return app
