"""The FastAPI app: OpenAI's /v1 routes, the /v1/sessions routes, /health and /metrics over a `ServerState`.

    app = create_app(ServerState(engine, tokenizer, "my-model"))
    uvicorn.run(app)                                   # or `astrai-pl serve --model DIR`

The generation routes run through generation.py; the sessions routes are serve/sessions_api.py's
`sessions_router(state)`. Every /v1 route needs the API key when the state has one. A middleware counts
requests for the metrics and turns an exception no handler took into a 500 in OpenAI's shape.
"""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.routing import Match

from .adapters_api import adapters_router
from .errors import error_body, install_error_handlers, internal_error
from .generation import generate, off_loop
from .lora_models import adapter_cards
from .protocol import chat_call, completion_call
from .sessions_api import sessions_router
from .state import ServerState

PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


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
        state.close()

    # no /openapi.json, /docs or /redoc: they would describe the API to anyone, key or not
    app = FastAPI(title="astrai_pl", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    install_error_handlers(app)
    labelled: list = []  # every route, for the metrics' route labels (filled below)
    app.add_middleware(MetricsMiddleware, state=state, routes=labelled)

    async def authorized(request: Request) -> None:
        request.state.key_salt = state.check_key(request.headers.get("authorization"))

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorized)])

    def card() -> dict:
        return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "astrai_pl",
                "max_model_len": state.context_len}

    @v1.get("/models")
    async def models() -> dict:
        return {"object": "list", "data": [card(), *adapter_cards(state, state.created)]}

    @v1.get("/models/{model:path}")
    async def model(model: str) -> dict:
        state.check_model(model)
        return next((c for c in adapter_cards(state, state.created) if c["id"] == model), None) or card()

    @v1.post("/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, state, off_loop(completion_call))

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, state, off_loop(chat_call))

    sessions = sessions_router(state)
    app.include_router(v1)
    app.include_router(sessions, dependencies=[Depends(authorized)])
    app.include_router(adapters := adapters_router(state), dependencies=[Depends(authorized)])

    @app.get("/health")
    async def health() -> Response:
        if state.engine.running:
            return JSONResponse({"status": "ok"})
        return JSONResponse(error_body("the engine loop is not running", "server_error"), status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=PROMETHEUS_TEXT)

    labelled += [r for router in (v1, sessions, adapters, app.router) for r in router.routes if hasattr(r, "path")]
    return app
