"""Sessions: a conversation's state kept in the KV pool between turns, like a recurrent model's state.

A session holds its tokens, the pages with their K/V (full pages pinned in the radix cache, the last
partial page private) and, after a prefill-only turn, the next-token logits. A turn appends tokens and
computes only those, never the history again:

    chat = engine.session(ttl=600)
    chat.generate("Hi!", params)          # prefill + decode
    chat.generate(" And then?", params)   # only the new tokens (and the last reply token) are computed
    branch = chat.fork()                  # copy-on-write: full pages shared, the partial page copied
    chat.save("chat.safetensors")         # tokens + K/V + model fingerprint
    engine.load_session("chat.safetensors")

After `ttl` seconds without use a session expires: its pages are unpinned (cached full pages become
evictable, the partial page is freed) but its tokens stay, so it can still continue — recomputing
whatever the cache no longer holds.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import count
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .cache import CapacityError, InferenceError
from .request import Completion, Delta, Request
from .sampling import SamplingParams

if TYPE_CHECKING:
    from .engine import Engine, Prompt

FORMAT = "astrai_pl.session"
_ids = count()


class SessionError(InferenceError, ValueError):
    """A session is used while busy or closed, or a saved one does not fit this engine's model."""


def model_fingerprint(model) -> str:
    """SHA-256 over the config, every tensor's name, shape and dtype, and up to 4096 of its values."""
    digest = hashlib.sha256(json.dumps(model.config.to_dict(), sort_keys=True, default=str).encode())
    for name, tensor in sorted(model.state_dict().items()):
        flat = tensor.detach().reshape(-1)
        picked = flat[:: max(1, flat.numel() // 4096)][:4096].to("cpu", torch.float64)
        digest.update(f"{name}{tuple(tensor.shape)}{tensor.dtype}".encode())
        digest.update(picked.numpy().tobytes())
    return digest.hexdigest()


@dataclass(frozen=True)
class SessionMemory:
    tokens: int  # tokens in the conversation
    cached_tokens: int  # of which K/V is in the pool
    pages: int
    shared_pages: int  # also held by the radix cache, a fork or a request
    bytes: int


class Session:
    def __init__(self, engine: Engine, ttl: float | None = None):
        self.engine, self.ttl = engine, ttl
        self.id = f"session-{next(_ids)}"
        self.tokens: list[int] = []
        self.pages: list[int] = []
        self.num_computed = 0
        self.last_logits: torch.Tensor | None = None  # (V,) when every token is computed
        self.expired = self.closed = False
        self._busy: Request | None = None
        self.touch()

    # -- turns ----------------------------------------------------------------------------------------------
    def generate(self, prompt: Prompt | None = None, params: SamplingParams | None = None) -> Completion:
        """Append `prompt` (text or ids, may be empty) and generate a reply, which joins the session."""
        req = self._request(prompt, params)
        self.engine._submit(req)
        self.engine._run_until(lambda: req.finished)
        return req.completion()

    def stream(self, prompt: Prompt | None = None, params: SamplingParams | None = None) -> Iterator[Delta]:
        """Like `generate`, as deltas."""
        return self.engine._stream(self._request(prompt, params))

    def append(self, prompt: Prompt) -> None:
        """Add tokens without generating; they are computed now and the next-token logits kept."""
        self.generate(prompt, SamplingParams(max_tokens=0))

    def _request(self, prompt: Prompt | None, params: SamplingParams | None) -> Request:
        self._check_usable()
        params = params or SamplingParams()
        if params.n != 1:
            raise SessionError(
                f"a session continues one conversation, got SamplingParams.n={params.n}; use fork()"
            )
        req = self.engine._request(
            prompt if prompt is not None else [], params, session=self, history=self.tokens
        )
        req.pages, req.num_computed = self.pages, self.num_computed
        if self.num_computed:
            req.started, req.cached_tokens = True, min(self.num_computed, req.num_prompt)
        if self.num_computed == len(req.tokens):  # nothing new to compute: sample from the kept logits
            assert self.last_logits is not None, "a fully computed session keeps its logits"
            req.ready_logits = self.last_logits
        self.pages, self.last_logits, self._busy, self.expired = [], None, req, False
        return req

    def adopt(self, req: Request, last_logits: torch.Tensor | None) -> None:
        """Take back the state of this session's finished request (the engine calls this)."""
        pool = self.engine.pool
        if req.num_computed and pool.radix is not None:
            req.pages = pool.cache_prefix(req.tokens, req.pages, req.num_computed)
        self.pages, req.pages = req.pages, []
        if req.row is not None:
            pool.req_to_token.free(req.row)
            req.row = None
        self.tokens, self.num_computed = list(req.tokens), req.num_computed
        last_logits = req.ready_logits if last_logits is None else last_logits  # aborted before sampling
        if last_logits is not None and self.num_computed == len(self.tokens):
            self.last_logits = last_logits.clone()
        assert self.num_computed < len(self.tokens) or self.last_logits is not None, "computed without logits"
        self._busy = None
        self.touch()

    # -- lifetime -------------------------------------------------------------------------------------------
    def touch(self) -> None:
        self.expires_at = None if self.ttl is None else time.monotonic() + self.ttl

    def due(self, now: float | None = None) -> bool:
        """Whether the TTL has run out (never while a turn is running)."""
        if self.expires_at is None or self.expired or self.closed or self._busy is not None:
            return False
        return (time.monotonic() if now is None else now) >= self.expires_at

    def expire(self) -> None:
        """Unpin the pages: cached full pages become evictable, the partial page is freed; tokens stay."""
        if self._busy is not None:
            raise SessionError(f"{self.id} is running {self._busy.id}; it cannot expire mid-turn")
        self.engine.pool.release(self.pages)
        self.pages, self.num_computed, self.last_logits, self.expired = [], 0, None, True

    def close(self) -> None:
        """Abort a running turn, release every page and forget the session."""
        if self._busy is not None:
            self.engine.abort(self._busy.id)
        if not self.closed:
            self.engine.pool.release(self.pages)
            self.pages, self.closed = [], True
            self.engine.sessions.pop(self.id, None)

    def _check_usable(self) -> None:
        if self.closed:
            raise SessionError(f"{self.id} is closed; start a new one with engine.session()")
        if self._busy is not None:
            raise SessionError(f"{self.id} is running {self._busy.id}; wait for that turn to finish")

    # -- copies ---------------------------------------------------------------------------------------------
    def fork(self) -> Session:
        """An independent copy: full pages shared (copy-on-write), the partial page copied."""
        self._check_usable()
        child = self.engine.session(self.ttl)
        child.tokens = list(self.tokens)
        if self.pages:
            pages = self.engine.pool.fork(self.pages, self.num_computed)
            if pages is None:
                child.close()
                raise CapacityError(
                    f"no free page to copy {self.id}'s partial page; free memory or raise max_total_tokens"
                )
            child.pages, child.num_computed = pages, self.num_computed
        child.last_logits = None if self.last_logits is None else self.last_logits.clone()
        return child

    def memory(self) -> SessionMemory:
        refs, ps = self.engine.pool.allocator.refs, self.engine.page_size
        shared = sum(1 for p in self.pages if refs[p] > 1)
        per_token = self.engine.pool.storage.bytes_per_token
        return SessionMemory(
            len(self.tokens), self.num_computed, len(self.pages), shared, len(self.pages) * ps * per_token
        )

    def save(self, path: str | Path) -> None:
        """Write tokens, K/V of the computed tokens, last logits and the model fingerprint (safetensors)."""
        self._check_usable()
        pool = self.engine.pool
        slots = torch.tensor(
            pool.slots(self.pages, 0, self.num_computed), dtype=torch.int64, device=pool.storage.k.device
        )
        k, v = pool.storage.read(slots)  # (layers, num_computed, Hkv, D)
        tensors = {"tokens": torch.tensor(self.tokens, dtype=torch.int64), "k": k.cpu(), "v": v.cpu()}
        if self.last_logits is not None:
            tensors["last_logits"] = self.last_logits.cpu()
        metadata = {
            "format": FORMAT,
            "version": "1",
            "fingerprint": model_fingerprint(self.engine.model),
            "num_computed": str(self.num_computed),
        }
        save_file({name: t.contiguous() for name, t in tensors.items()}, str(path), metadata=metadata)


def load_session(engine: Engine, path: str | Path, ttl: float | None = None) -> Session:
    """Read a saved session into `engine`'s pool (the engine registers it)."""
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
        if metadata.get("format") != FORMAT:
            raise SessionError(
                f"{path} is not a saved session (format {metadata.get('format')!r}); "
                "pass a file written by Session.save"
            )
        fingerprint = model_fingerprint(engine.model)
        if metadata.get("fingerprint") != fingerprint:
            raise SessionError(
                f"{path} was saved from a different model (fingerprint {metadata.get('fingerprint', '?')[:12]} "
                f"!= {fingerprint[:12]}); load it into an engine on the same weights and dtype, or start a new session"
            )
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    session = Session(engine, ttl)
    session.tokens = tensors["tokens"].tolist()
    computed = int(metadata["num_computed"])
    if computed == len(session.tokens) and "last_logits" not in tensors:
        computed -= 1  # without the logits the last token is recomputed, so its K/V are not needed
    if computed:
        pool = engine.pool
        pages = pool.allocate(pool.pages_for(computed))
        if pages is None:
            raise CapacityError(
                f"{path} needs {pool.pages_for(computed)} free pages, the pool has "
                f"{pool.available()}; free memory or raise max_total_tokens"
            )
        slots = torch.tensor(pool.slots(pages, 0, computed), dtype=torch.int64, device=pool.storage.k.device)
        pool.storage.k[:, slots] = tensors["k"].to(pool.storage.k)
        pool.storage.v[:, slots] = tensors["v"].to(pool.storage.v)
        session.pages = pool.cache_prefix(session.tokens, pages, computed)
        session.num_computed = computed
    if "last_logits" in tensors:
        session.last_logits = tensors["last_logits"].to(engine.device)
    return session
