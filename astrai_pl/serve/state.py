"""What every route of the server shares: the running engine, its tokenizer, the limits, metrics and sessions.

`ServerState` starts the engine's background loop, so requests submitted from the event loop are stepped
together in one batch. The sessions routes (serve/sessions_api.py) keep their store on `state.sessions`.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from ..inference import Engine, RequestHandle
from ..inference.adapters import lora_adapters
from ..tokenizer import Tokenizer
from .errors import APIError
from .limits import text_limit
from .metrics import Metrics


@dataclass(eq=False)
class ServerState:
    """The engine behind the routes and what limits them.

    model_name: the id clients pass as "model". api_key: when set, /v1 routes need `Authorization: Bearer KEY`
    (a list: any of these keys; an empty key is refused). salt_per_key: each key's requests share cached
    prefixes only with that key's (a request's own `cache_salt` divides them further). report_cached_tokens:
    whether `usage.prompt_tokens_details` tells a client how much of its prompt was cached. tokenize_workers:
    threads that parse and tokenize request bodies, off the event loop. max_queue: most generation requests in flight at once (more get 429). max_model_len: the longest prompt +
    completion served (default and ceiling: the engine's context). stop_token_ids: end ids besides the
    engine's (a Hugging Face directory's generation_config.json).
    """

    engine: Engine
    tokenizer: Tokenizer
    model_name: str
    api_key: str | list[str] | None = None
    salt_per_key: bool = False
    report_cached_tokens: bool = True
    tokenize_workers: int = 4
    max_queue: int | None = None
    max_model_len: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    tool_call_parser: str | None = None  # --tool-call-parser (serve/tools.py); None: chosen from the template
    metrics: Any = field(default_factory=Metrics)
    sessions: Any = None
    created: int = field(default_factory=lambda: int(time.time()))
    in_flight: int = 0
    handles: set[RequestHandle] = field(default_factory=set)  # submitted and not yet released

    def __post_init__(self) -> None:
        self.api_keys = check_api_keys(self.api_key)
        if self.salt_per_key and not self.api_keys:
            raise ValueError("salt_per_key needs API keys to tell clients apart (--api-key)")
        if self.tokenize_workers < 1:
            raise ValueError(f"tokenize_workers={self.tokenize_workers}: allow at least one thread")
        self.tokenize_pool = ThreadPoolExecutor(self.tokenize_workers, thread_name_prefix="astrai-tokenize")
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

    @cached_property
    def text_limit(self) -> tuple[int, int]:
        """(characters, context): text longer than that cannot fit the context and is refused unencoded."""
        return text_limit(self.tokenizer, self.context_len), self.context_len

    def pool_room(self, n: int) -> int:
        """Most tokens a prompt and its completion may hold for n samples of it to fit the KV pool together."""
        pool = self.engine.pool
        return pool.num_pages // n * pool.page_size

    def check_key(self, authorization: str | None) -> str | None:
        """Refuse (401) a request without one of the server's keys as `Authorization: Bearer KEY`; the cache
        salt of the key it gave (None: keys share the cache, or the server has none)."""
        if not self.api_keys:
            return None
        scheme, _, given = (authorization or "").partition(" ")
        given = given.strip().encode()
        matched = [hmac.compare_digest(given, key.encode()) for key in self.api_keys]  # every key compared
        if scheme.lower() != "bearer" or not any(matched):
            raise APIError(401, "missing or wrong API key; send the header 'Authorization: Bearer KEY' with the "
                                "server's --api-key", code="invalid_api_key")
        if not self.salt_per_key:
            return None
        return "key-" + hashlib.sha256(self.api_keys[matched.index(True)].encode()).hexdigest()[:32]

    async def off_loop(self, work, *args):
        """`work(*args)` on the server's own tokenizing threads (not asyncio's default executor, which other
        libraries share): the event loop goes on meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenize_pool, work, *args)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name and model not in lora_adapters(self.engine):
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

    def close(self) -> None:
        """Stop the tokenizing threads (the server is shutting down)."""
        self.tokenize_pool.shutdown(wait=False, cancel_futures=True)

    def abort_all(self) -> None:
        """Abort every request still running (the server is shutting down)."""
        for handle in list(self.handles):
            if not handle.done:
                handle.abort()
        self.handles.clear()


def check_api_keys(api_key: str | list[str] | None) -> list[str]:
    """The server's keys as a list; an empty one is refused (an unset `$KEY` would turn authentication off)."""
    keys = [] if api_key is None else [api_key] if isinstance(api_key, str) else list(api_key)
    for key in keys:
        if not isinstance(key, str) or not key.strip():
            raise ValueError(f"API key {key!r} is empty: it would let any client in; pass a non-empty "
                             "--api-key (or ASTRAI_API_KEY), or leave both out to serve without a key")
    return keys


def join_salts(key_salt: str | None, own: str | None) -> str | None:
    """The cache salt of a request: its key's (when keys are kept apart) and the one its body names."""
    if key_salt is None and own is None:
        return None
    return f"{key_salt or ''}|{own or ''}"
