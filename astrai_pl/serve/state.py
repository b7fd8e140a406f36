"""What every route of the server shares: the running engine, its tokenizer, the limits, metrics and sessions.

`ServerState` starts the engine's background loop, so requests submitted from the event loop are stepped
together in one batch. The sessions routes (serve/sessions_api.py) keep their store on `state.sessions`.
"""

from __future__ import annotations

import hmac
import time
from dataclasses import dataclass, field
from typing import Any

from ..inference import Engine, RequestHandle
from ..tokenizer import Tokenizer
from .errors import APIError
from .metrics import Metrics


@dataclass(eq=False)
class ServerState:
    """The engine behind the routes and what limits them.

    model_name: the id clients pass as "model". api_key: when set, /v1 routes need `Authorization: Bearer KEY`.
    max_queue: most generation requests in flight at once (more get 429). max_model_len: the longest prompt +
    completion served (default and ceiling: the engine's context). stop_token_ids: end ids besides the
    engine's (a Hugging Face directory's generation_config.json).
    """

    engine: Engine
    tokenizer: Tokenizer
    model_name: str
    api_key: str | None = None
    max_queue: int | None = None
    max_model_len: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    metrics: Any = field(default_factory=Metrics)
    sessions: Any = None
    created: int = field(default_factory=lambda: int(time.time()))
    in_flight: int = 0
    handles: set[RequestHandle] = field(default_factory=set)  # submitted and not yet released

    def __post_init__(self) -> None:
        if self.max_queue is not None and self.max_queue < 1:
            raise ValueError(f"max_queue={self.max_queue}: allow at least one request, or None for no limit")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len={self.max_model_len}: needs room for a prompt token and one more")
        if not self.engine.running:
            self.engine.start()
        self.metrics.watch(self)  # the gauges read this state's engine and sessions at scrape time

    @property
    def context_len(self) -> int:
        """Most tokens, prompt and completion together, one request may hold."""
        limit = self.engine.max_context
        return limit if self.max_model_len is None else min(limit, self.max_model_len)

    def pool_room(self, n: int) -> int:
        """Most tokens a prompt and its completion may hold for n samples of it to fit the KV pool together."""
        pool = self.engine.pool
        return pool.num_pages // n * pool.page_size

    def check_key(self, authorization: str | None) -> None:
        """Refuse (401) a request without the server's key as `Authorization: Bearer KEY`."""
        if self.api_key is None:
            return
        scheme, _, given = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self.api_key.encode()):
            raise APIError(401, "missing or wrong API key; send the header 'Authorization: Bearer KEY' with the "
                                "server's --api-key", code="invalid_api_key")

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model '{model[:80]}' does not exist; this server serves '{self.model_name}' "
                                "(GET /v1/models)", param="model", code="model_not_found")

    def admit(self) -> None:
        """Count one more request in flight, or refuse (429) when --max-queue are."""
        if self.max_queue is not None and self.in_flight >= self.max_queue:
            raise APIError(429, f"{self.in_flight} requests are in flight, the server takes {self.max_queue} at "
                                "once (--max-queue); retry later", type="rate_limit_error",
                           code="rate_limit_exceeded")
        self.in_flight += 1

    def release(self) -> None:
        self.in_flight -= 1

    def abort_all(self) -> None:
        """Abort every request still running (the server is shutting down)."""
        for handle in list(self.handles):
            if not handle.done:
                handle.abort()
        self.handles.clear()
