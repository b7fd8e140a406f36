"""A session's state over HTTP: export and upload for every model, and the RWKV state operations.

    GET  /v1/sessions/{id}/state                 the session as a file (safetensors), what Session.save writes
    POST /v1/sessions  (Content-Type: application/octet-stream, body: such a file, ?ttl=S)   a session on it
    POST /v1/sessions/{id}/blend     {"other": ID, "alpha": 0..1, "ttl"?}   a new session on (1 − α)·id + α·other
    POST /v1/sessions/{id}/scale     {"component", "factor", "layers"?}      the session's state edited in place
    GET  /v1/sessions/{id}/inspect                per layer and component: mean |x|, max |x|, L2
    GET  /v1/sessions/{id}/distance?other=ID      per layer and component: L2 and cosine

The exported file is exactly what `Session.save` writes, with one more header entry, `messages` (JSON): the
conversation the session's turns were rendered from, so that an upload's next turn renders like the
original's. A file without it (one `Session.save` wrote) loads too; its first turn's messages are then
rendered after the file's tokens as the template opens a conversation. An uploaded file is untrusted. It is read no further than the server's body limit (413 beyond), written to a
private temporary file and loaded by the engine's own `load_session`, which checks it exactly as a local file
(format, version, model fingerprint, every tensor's dtype, shape and values), and its `messages` as a
request's are; a refusal is a 400 that names the field. Its state never enters the prefix cache. An RWKV engine's file is the state file format
(recurrent/files.py), an attention engine's its K/V file (sessions.py); each loads only into the model that
wrote it.

blend, scale, inspect and distance work on an RWKV model's fixed-size state; on an attention model they are
refused with a 400 saying why. A blended or edited state no longer follows from the session's tokens, so its
turns keep a copy of the state until they finish: a turn that fails or is abandoned leaves the state as it
was (`StoredSession.backup`). Session ids are bearer tokens: `other` must be a live id like the session's own.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import asdict
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field
from safetensors import safe_open
from safetensors.torch import save as save_tensors

from ..inference import CapacityError
from ..inference.recurrent.held import (
    blend_held,
    held_distance,
    inspect_held,
    needs_flush,
    refuse_attention,
    scale_held,
)
from ..inference.sessions import SessionError
from .bodies import parse_body
from .errors import APIError, bad_request
from .generation import MAX_BODY_BYTES, read_bytes, read_json
from .messages import chat_messages
from .state import join_salts

FILE_TYPES = ("application/octet-stream", "application/vnd.safetensors")
UPLOAD_NAME = "the uploaded session file"


class BlendRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    other: str = Field(max_length=200)
    alpha: float
    ttl: float | None = None


class ScaleRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    component: str = Field(max_length=40)
    factor: float
    layers: list[int] | None = Field(default=None, max_length=4096)


def is_upload(request: Request) -> bool:
    """Whether a POST /v1/sessions carries a session file rather than a JSON body."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    return kind in FILE_TYPES


async def read_upload(request: Request) -> bytes:
    """The body's bytes, no further than MAX_BODY_BYTES (413 beyond)."""
    raw = await read_bytes(request, MAX_BODY_BYTES, "the session file")
    if not raw:
        raise bad_request("the request body is empty; send a session file written by GET /v1/sessions/{id}/state "
                          "or Session.save", "file")
    return raw


def _refusal(err: Exception, path: str | None = None) -> APIError:
    """A 400 for a refused session operation or file, the temporary path replaced by what the client sent."""
    message = str(err).replace(path, UPLOAD_NAME) if path else str(err)
    return bad_request(message, "file" if path else None)


def load_upload(engine, data: bytes, ttl: float):
    """(an engine session on the uploaded file `data`, checked by the engine's `load_session`; its messages)."""
    with tempfile.TemporaryDirectory(prefix="astrai-session-") as folder:
        path = os.path.join(folder, "upload.safetensors")
        Path(path).write_bytes(data)
        try:
            session = engine.load_session(path, ttl)
        except SessionError as err:
            raise _refusal(err, path) from None
        except CapacityError as err:
            raise APIError(429, f"{str(err).replace(path, UPLOAD_NAME)}; retry later", type="rate_limit_error",
                           code="kv_pool_full") from None
        try:
            with safe_open(path, framework="pt") as f:
                return session, _file_messages((f.metadata() or {}).get("messages"))
        except BaseException:
            session.close()
            raise


def _file_messages(text: str | None) -> list[dict]:
    """The `messages` header entry of an uploaded file, checked as a request's messages are ([] when absent)."""
    if text is None:
        return []
    try:
        return chat_messages(json.loads(text))
    except (ValueError, APIError) as err:
        raise bad_request(f"{UPLOAD_NAME}: its header's messages are not a conversation "
                          f"({getattr(err, 'message', err)}); export the session again", "file") from None


def export_bytes(session, messages: list[dict]) -> bytes:
    """What `session.save` writes, with `messages` added to its header (see the module's docstring)."""
    with tempfile.TemporaryDirectory(prefix="astrai-session-") as folder:
        path = os.path.join(folder, "session.safetensors")
        session.save(path)
        with safe_open(path, framework="pt") as f:  # header and tensors in one read of the file
            metadata = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    return save_tensors(tensors, metadata={**metadata, "messages": json.dumps(messages)})


def report_rows(report) -> list[dict]:
    """A StateReport's rows as JSON objects; a number past float64's range becomes null."""
    return [{k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in asdict(row).items()}
            for row in report.rows]


def _checked(work, *args):
    """`work(*args)`, its refusals (SessionError, ValueError) as 400s."""
    try:
        return work(*args)
    except (SessionError, ValueError) as err:
        raise _refusal(err) from None


def state_routes(router: APIRouter, state, store, flush) -> None:
    """Add the routes of this module's docstring to the /v1/sessions `router` (see sessions_api.py).
    `flush(stored)` computes a session's pending reply token (a prefill-only turn)."""

    async def ready(session_id: str):
        stored = store.idle(session_id)
        if needs_flush(stored.session):
            await flush(stored)
        return stored

    async def ready_pair(session_id: str, other_id: str, what: str):
        stored = store.idle(session_id)
        _checked(refuse_attention, stored.session, what)  # before the other id is looked at
        if other_id == session_id:
            return await ready(session_id), None
        return await ready(session_id), await ready(other_id)

    @router.get("/{session_id}/state")
    async def export(session_id: str) -> Response:
        stored = store.idle(session_id)
        data = await state.off_loop(_checked, export_bytes, stored.session, stored.messages)
        return Response(data, media_type="application/octet-stream",
                        headers={"Content-Disposition": 'attachment; filename="session.safetensors"'})

    @router.post("/{session_id}/blend")
    async def blend(session_id: str, request: Request) -> dict:
        body = parse_body(await read_json(request), BlendRequest)
        ttl = store.ttl_for(body.ttl) if body.ttl is not None else store.get(session_id).ttl
        stored, other = await ready_pair(session_id, body.other, "blend")
        store.check_room()
        store.reserve(None, state.engine.page_size)  # the new state
        session = await state.off_loop(_checked, blend_held, stored.session, (other or stored).session,
                                       body.alpha)
        session.ttl = ttl
        session.touch()  # its expiry counts from now, under its own TTL
        return store.adopt(session, list(stored.messages), stored.cache_salt).describe()

    @router.post("/{session_id}/scale")
    async def scale(session_id: str, request: Request) -> dict:
        body = parse_body(await read_json(request), ScaleRequest)
        _checked(refuse_attention, store.idle(session_id).session, "scale")
        stored = await ready(session_id)
        await state.off_loop(_checked, scale_held, stored.session, body.component, body.factor, body.layers)
        stored.derived = True
        return stored.describe()

    @router.get("/{session_id}/inspect")
    async def inspect(session_id: str) -> dict:
        _checked(refuse_attention, store.idle(session_id).session, "inspect")
        stored = await ready(session_id)
        report = await state.off_loop(_checked, inspect_held, stored.session)
        return {"id": session_id, "object": "session.state_stats", "data": report_rows(report)}

    @router.get("/{session_id}/distance")
    async def distance(session_id: str, other: str) -> dict:
        stored, partner = await ready_pair(session_id, other, "distance")
        report = await state.off_loop(_checked, held_distance, stored.session, (partner or stored).session)
        return {"id": session_id, "other": other, "object": "session.state_distance", "data": report_rows(report)}


async def upload(request: Request, state, store) -> dict:
    """POST /v1/sessions with a session file as the body: a new session on it (ttl from the query)."""
    ttl_text = request.query_params.get("ttl")
    try:
        ttl = store.ttl_for(None if ttl_text is None else float(ttl_text))
    except ValueError:
        raise bad_request(f"'ttl'={ttl_text[:40]!r} is not a number of seconds", "ttl") from None
    data = await read_upload(request)
    store.check_room()
    session, messages = await state.off_loop(load_upload, state.engine, data, ttl)
    try:
        store.reserve(None, len(session.pages) * state.engine.page_size if session.pages else 0)
    except APIError:
        session.close()
        raise
    salt = join_salts(getattr(request.state, "key_salt", None), None)
    return store.adopt(session, messages, salt).describe()

