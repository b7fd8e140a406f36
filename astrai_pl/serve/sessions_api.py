"""/v1/sessions: conversations whose K/V stay in the engine's pool between HTTP calls (engine `Session`s).

    POST   /v1/sessions                        {"model"?, "messages"? (prefilled now), "ttl"?}: a new session
    POST   /v1/sessions/{id}/chat/completions  OpenAI's chat completion; "messages" holds only the new turn(s)
    POST   /v1/sessions/{id}/fork              a copy-on-write copy (full pages shared) that goes its own way
    GET    /v1/sessions/{id}                   tokens, pages, bytes, expires_at
    DELETE /v1/sessions/{id}                   closed now, its pages freed

A turn renders the whole conversation (the stored messages, the new ones, the generation prompt) with the
chat template. When the session's tokens are a prefix of that render — the usual case — only the rest is
computed, and the reply is the one a stateless /v1/chat/completions on the whole conversation gives. When
they are not (a reply's tokens differ from the template's rendering of its text: it ended on a stop string,
which its tokens hold and its text does not, or its text encodes to other ids), the session keeps its own
tokens and appends only the part of the render after the history's own render: the history is not computed
again, and the prompt differs from a stateless request's in that reply. `cached_tokens` counts the tokens
not computed again.

Ids are `secrets.token_urlsafe` strings, only ever keys of a dict. An unknown, deleted or expired id is a
404; a turn or fork while a turn runs on the session a 409; the store refuses (429) a session over
`max_sessions`, or a prefill or turn that could make the sessions pin more than `max_tokens` of KV: a turn
reserves its whole conversation plus its `max_tokens` (left out, it gets what the limit leaves), since the
session keeps the pages its reply is generated into. A session idle for its TTL is closed and forgotten. A
turn the client walks away from is aborted, and the session goes on from its history without it.

A session's prefixes are cached under the salt it was created with (its key's, when keys are kept apart, and
the `cache_salt` its creating request named); its turns use that salt whatever their body says.
"""

from __future__ import annotations

import secrets
import time

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from ..commands import bos_first
from ..inference import CapacityError, Completion, InferenceError, PromptError, SamplingParams, Session
from ..inference.adapters import bind_session, session_adapter
from ..inference.scheduler import common_prefix
from ..tokenizer import TokenizerError
from .bodies import parse_body
from .errors import APIError, bad_request
from .generation import Generation, _engine_error, generate, read_json
from .lora_models import adapter_name
from .messages import chat_messages
from .protocol import chat_call, templated_ids
from .state import join_salts
from .state_api import is_upload, state_routes, upload

DEFAULT_TTL_S = 600.0
DEFAULT_MAX_TTL_S = 3600.0
DEFAULT_MAX_SESSIONS = 256


class SessionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    messages: list | None = None
    ttl: float | None = None
    cache_salt: str | None = Field(default=None, max_length=256)


class StoredSession:
    """One conversation: its engine session, the messages and tokens of its finished turns, its lifetime."""

    def __init__(self, store: SessionStore, session: Session, ttl: float, messages: list[dict],
                 cache_salt: str | None = None):
        self.store, self.session, self.ttl, self.cache_salt = store, session, ttl, cache_salt
        self.id = "sess_" + secrets.token_urlsafe(24)
        self.created = int(time.time())
        self.messages = messages
        self.tokens: list[int] = list(session.tokens)
        self.busy = False
        self.reserved_pages = 0  # what a running turn may come to pin: its conversation and max_tokens
        self.closed = False
        self.derived = False  # its state does not follow from its tokens (uploaded, blended, edited: state_api.py)
        self.backup: Session | None = None  # a derived session's state while a turn runs on it

    def conversation(self, render: list[int], tokenizer) -> list[int]:
        """The ids the next turn continues from: `render` (the whole conversation templated) when the
        history's tokens are a prefix of it, else the history's tokens and the part of `render` after the
        history's own render (see the module's docstring)."""
        if render[: len(self.tokens)] == self.tokens:
            return render
        if not self.messages:  # an uploaded session: what the render opens a conversation with is not repeated
            base = bos_first(tokenizer, [])
        else:
            base = templated_ids(tokenizer, self.messages, generation_prompt=False)
        return self.tokens + render[common_prefix(render, base):]

    def settle(self, new: list[dict], completion: Completion | None) -> None:
        """After a turn: a finished reply joins the history; a turn that did not finish leaves none of its
        tokens behind (an aborted turn hands what it computed to the session, which starts again from the
        history: its full pages are still in the prefix cache)."""
        self.busy, self.reserved_pages = False, 0
        backup, self.backup = self.backup, None
        if self.closed:
            return
        finished = completion is not None and completion.finish_reason in ("stop", "length")
        if backup is not None and not finished:  # the state its tokens could not compute again
            self.session.close()
            self.session = backup
        elif backup is not None:
            backup.close()
        if finished:
            self.messages = [*self.messages, *new, {"role": "assistant", "content": completion.text}]
            self.tokens = list(self.session.tokens)
        elif self.session.tokens != self.tokens:
            self.session.close()
            self.session = self.store.engine.session(self.ttl)
        self.session.touch()

    def due(self) -> bool:
        return not self.busy and (self.session.expired or self.session.due())

    def describe(self) -> dict:
        memory = self.session.memory()
        left = 0.0 if self.session.expires_at is None else self.session.expires_at - time.monotonic()
        return {"id": self.id, "object": "session", "created": self.created,
                "expires_at": int(time.time() + max(0.0, left)), "tokens": len(self.tokens),
                "cached_tokens": memory.cached_tokens, "pages": memory.pages,
                "shared_pages": memory.shared_pages, "bytes": memory.bytes, "messages": len(self.messages)}


class SessionStore:
    """The live sessions of a server, by id, and their limits.

    ttl: seconds a session lives idle when the request names none; max_ttl: the most a request may ask.
    max_sessions: live sessions at once. max_tokens: KV tokens (counted in whole pages) all sessions may
    pin together (default: half the pool, so stateless requests keep room).
    """

    def __init__(self, engine, ttl: float = DEFAULT_TTL_S, max_ttl: float = DEFAULT_MAX_TTL_S,
                 max_sessions: int = DEFAULT_MAX_SESSIONS, max_tokens: int | None = None):
        if not 0 < ttl <= max_ttl:
            raise ValueError(f"the session TTL {ttl} s must be positive and at most the maximum TTL "
                             f"{max_ttl} s (--session-ttl, --max-session-ttl)")
        if max_sessions < 1:
            raise ValueError(f"max_sessions={max_sessions}: allow at least one session (--max-sessions)")
        self.engine, self.ttl, self.max_ttl, self.max_sessions = engine, ttl, max_ttl, max_sessions
        usage = engine.usage()
        total = usage.total * usage.page_size
        self.max_pages = (total // 2 if max_tokens is None else min(max_tokens, total)) // usage.page_size
        if self.max_pages < 1:
            raise ValueError(f"max_tokens={max_tokens} is below one KV page of {usage.page_size} tokens "
                             "(--max-session-tokens); raise it")
        self._sessions: dict[str, StoredSession] = {}

    def live(self) -> int:
        self.sweep()
        return len(self._sessions)

    def __len__(self) -> int:
        return len(self._sessions)

    def sweep(self) -> None:
        """Close and forget every session idle past its TTL."""
        for stored in [s for s in self._sessions.values() if s.due()]:
            self.close(stored.id)

    def get(self, session_id: str) -> StoredSession:
        self.sweep()
        stored = self._sessions.get(session_id)
        if stored is None:
            raise APIError(404, f"no session '{session_id[:80]}': it expired, was deleted or never existed; "
                                "start one with POST /v1/sessions", param="session_id",
                           code="session_not_found")
        return stored

    def idle(self, session_id: str) -> StoredSession:
        """The session, refused (409) while a turn runs on it."""
        stored = self.get(session_id)
        if stored.busy:
            raise APIError(409, f"session '{session_id}' is answering another turn; wait for it to finish, "
                                "or fork the session when it is idle to branch", param="session_id",
                           code="session_busy")
        return stored

    def ttl_for(self, requested: float | None) -> float:
        if requested is None:
            return self.ttl
        if not 0 < requested <= self.max_ttl:
            raise bad_request(f"'ttl'={requested} must be positive seconds and at most {self.max_ttl} "
                              "(the server's --max-session-ttl)", "ttl")
        return float(requested)

    def pinned_pages(self, without: StoredSession | None = None) -> int:
        """Pages the sessions hold (each shared page once) and what their running turns may come to hold."""
        held: set[int] = set()
        reserved = 0
        for stored in self._sessions.values():
            if stored is without:
                continue
            held.update(stored.session.pages)
            reserved += stored.reserved_pages
        return len(held) + reserved

    def room(self, stored: StoredSession | None) -> int:
        """Tokens of KV `stored` may hold, its own pages aside, before the sessions pass the limit."""
        return (self.max_pages - self.pinned_pages(without=stored)) * self.engine.page_size

    def reserve(self, stored: StoredSession | None, tokens: int) -> int:
        """The pages a session of `tokens` tokens needs, refused (429) when they would pass the limit."""
        need = -(-tokens // self.engine.page_size)
        pinned = self.pinned_pages(without=stored)
        if pinned + need > self.max_pages:
            ps = self.engine.page_size
            raise APIError(429, f"sessions pin {pinned * ps} tokens of KV and this needs {need * ps} more, "
                                f"over the server's {self.max_pages * ps} (--max-session-tokens); delete "
                                "sessions you no longer need (DELETE /v1/sessions/{id}) or retry later",
                           type="rate_limit_error", code="session_memory_full")
        return need

    def check_room(self) -> None:
        """A 429 when `max_sessions` are live."""
        self.sweep()
        if len(self._sessions) >= self.max_sessions:
            raise APIError(429, f"{len(self._sessions)} sessions are live, the server keeps at most "
                                f"{self.max_sessions} (--max-sessions); delete sessions you no longer need "
                                "(DELETE /v1/sessions/{id}) or retry later", type="rate_limit_error",
                           code="too_many_sessions")

    def open(self, ttl: float, messages: list[dict], warm: list[int], cache_salt: str | None = None
             ) -> StoredSession:
        self.check_room()
        self.reserve(None, len(warm))
        stored = StoredSession(self, self.engine.session(ttl), ttl, messages, cache_salt)
        self._sessions[stored.id] = stored
        return stored

    def fork(self, stored: StoredSession) -> StoredSession:
        self.check_room()
        self.reserve(None, self.engine.page_size if stored.session.pages else 0)  # the partial page's copy
        try:
            session = stored.session.fork()
        except CapacityError as err:
            raise APIError(429, f"cannot fork: {err}; retry later", type="rate_limit_error",
                           code="kv_pool_full") from None
        child = StoredSession(self, session, stored.ttl, list(stored.messages), stored.cache_salt)
        child.derived = stored.derived
        self._sessions[child.id] = child
        return child

    def adopt(self, session: Session, messages: list[dict], cache_salt: str | None) -> StoredSession:
        """Keep an engine session made outside `open` and `fork` (state_api.py: uploaded or blended), derived."""
        stored = StoredSession(self, session, session.ttl, messages, cache_salt)
        stored.derived = True
        self._sessions[stored.id] = stored
        return stored

    def close(self, session_id: str) -> None:
        stored = self._sessions.pop(session_id, None)
        if stored is not None:
            stored.closed = True
            stored.session.close()
            if stored.backup is not None:
                stored.backup.close()

    def close_all(self) -> None:
        for session_id in list(self._sessions):
            self.close(session_id)


class SessionTurn(Generation):
    """A chat completion on a stored session: the new ids go to its engine session, and the reply joins
    its history as soon as the last token is in (before the response or the stream's end is sent)."""

    def __init__(self, state, call, stored: StoredSession, new: list[dict], need: int):
        self.stored, self.new, self.settled = stored, new, False
        stored.busy, stored.reserved_pages = True, need
        super().__init__(state, call)

    def submit(self, ids: list[int]):
        held = self.stored.session.tokens
        assert ids[: len(held)] == held, "a turn continues its session's tokens"
        if self.stored.derived:
            self.stored.backup = self.stored.session.fork()
        return self.stored.session.submit(ids[len(held):], self.call.params)

    async def events(self):
        async for item in super().events():
            yield item
        self.settle()
        reply = self.completions[0]
        if self.stored.closed and (reply is None or reply.finish_reason == "abort"):
            raise APIError(404, f"session '{self.stored.id}' was deleted during this turn, which stopped there",
                           param="session_id", code="session_not_found")

    def settle(self) -> None:
        if not self.settled:
            self.settled = True
            self.stored.settle(self.new, self.completions[0])

    def close(self) -> None:
        super().close()
        self.settle()


def _turn_parser(store: SessionStore, session_id: str, box: dict):
    """The chat_call parser for a turn: the stored conversation, then the body's messages."""

    async def parse(raw: dict, state):
        stored = store.idle(session_id)
        new = chat_messages(raw.get("messages"))
        history = stored.messages
        call = await state.off_loop(chat_call, {**raw, "messages": [*history, *new]}, state)
        if store.idle(session_id).messages is not history:  # a turn ran meanwhile: the ids above miss it
            raise APIError(409, f"session '{session_id}' answered another turn while this one was read; send it "
                                "again", param="session_id", code="session_busy")
        if call.params.n != 1:
            raise bad_request(f"'n'={call.params.n}: a session continues one conversation; fork it "
                              "(POST /v1/sessions/{id}/fork) for each branch", "n")
        ids = stored.conversation(call.prompts[0], state.tokenizer)
        call.prompts = [ids]
        call.params.cache_salt, call.salted = stored.cache_salt, True
        call.params.lora_name = session_adapter(stored.session)  # a body's `model` may name it (or refuse)
        if raw.get("max_tokens") is None and raw.get("max_completion_tokens") is None:  # what the limit leaves
            call.params.max_tokens = max(1, min(call.params.max_tokens, store.room(stored) - len(ids)))
        need = store.reserve(stored, len(ids) + call.params.max_tokens)  # the reply's pages stay the session's
        box.update(stored=stored, new=new, need=need)
        return call

    return parse


def _warm_ids(state, messages) -> tuple[list[dict], list[int]]:
    """A new session's opening messages and their ids (no generation prompt: the first turn adds it); no
    messages and an empty list both open an empty session."""
    if messages is None or messages == []:
        return [], []
    checked = chat_messages(messages)
    if state.tokenizer.chat_template is None:
        raise bad_request("this model's tokenizer has no chat template; sessions need one", "messages")
    try:
        ids = templated_ids(state.tokenizer, checked, generation_prompt=False, limit=state.text_limit)
    except TokenizerError as err:
        raise bad_request(str(err), "messages") from None
    if len(ids) >= state.context_len:
        raise bad_request(f"'messages' render to {len(ids)} tokens, the context holds {state.context_len}; "
                          "shorten them", "messages")
    return checked, ids


async def _prefill(state, stored: StoredSession, ids: list[int]) -> None:
    """Compute a new session's opening ids now (a prefill-only turn), off the event loop's thread."""
    state.admit()
    stored.busy = True
    try:
        handle = stored.session.submit(ids, SamplingParams(max_tokens=0, cache_salt=stored.cache_salt,
                                                           lora_name=session_adapter(stored.session)))
        try:
            await handle.result_async()
        finally:
            if not handle.done:
                handle.abort()
    except (PromptError, CapacityError) as err:
        raise bad_request(str(err), "messages") from None
    except InferenceError as err:
        raise _engine_error(err) from None
    finally:
        state.release()
        stored.busy = False
    stored.tokens = list(stored.session.tokens)
    stored.session.touch()


def sessions_router(state) -> APIRouter:
    """The /v1/sessions routes over `state` (its store on `state.sessions`, made with defaults if unset)."""
    if state.sessions is None:
        state.sessions = SessionStore(state.engine)
    store: SessionStore = state.sessions
    router = APIRouter(prefix="/v1/sessions")  # create_app puts it behind the API key like every /v1 route

    @router.post("")
    async def create(request: Request) -> dict:
        if is_upload(request):  # a session file as the body (state_api.py)
            return await upload(request, state, store)
        body = parse_body(await read_json(request), SessionRequest)
        state.check_model(body.model)
        ttl = store.ttl_for(body.ttl)
        messages, ids = await state.off_loop(_warm_ids, state, body.messages)  # see generation.off_loop
        stored = store.open(ttl, messages, ids, join_salts(getattr(request.state, "key_salt", None), body.cache_salt))
        bind_session(state.engine, stored.session, adapter_name(state, body.model))
        if ids:
            try:
                await _prefill(state, stored, ids)
            except BaseException:
                store.close(stored.id)
                raise
        if await request.is_disconnected():  # no one would learn its id: it would pin its pages for its TTL
            store.close(stored.id)
            raise APIError(499, "the client disconnected", code="client_closed_request")
        return stored.describe()

    @router.get("/{session_id}")
    async def describe(session_id: str) -> dict:
        return store.get(session_id).describe()

    @router.delete("/{session_id}")
    async def delete(session_id: str) -> dict:
        store.get(session_id)
        store.close(session_id)
        return {"id": session_id, "object": "session.deleted", "deleted": True}

    @router.post("/{session_id}/fork")
    async def fork(session_id: str) -> dict:
        return store.fork(store.idle(session_id)).describe()

    @router.post("/{session_id}/chat/completions")
    async def turn(session_id: str, request: Request) -> Response:
        box: dict = {}
        return await generate(request, state, _turn_parser(store, session_id, box),
                              start=lambda st, call: SessionTurn(st, call, **box))

    state_routes(router, state, store, flush=lambda stored: _prefill(state, stored, []))
    return router
