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

K/V read from a file are untrusted: a loaded session, its forks and its turns keep their pages private
(`kv_from_file`), never in the radix cache, until the session has none left (it expired, or a turn
failed or was preempted) and the engine computes its tokens again.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import count
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .admission import Prompt
from .cache import CapacityError, InferenceError
from .request import Completion, Delta, Request
from .sampling import SamplingParams

FORMAT = "astrai_pl.session"
VERSION = "2"  # version 1 files carry a fingerprint of sampled weights, which version 2 does not trust
_HASH_CHUNK = 1 << 24  # elements hashed per host copy
_ids = count()


class SessionError(InferenceError, ValueError):
    """A session is used while busy or closed, or a saved one does not fit this engine's model."""


def model_fingerprint(model) -> str:
    """BLAKE2b over the config, the LoRA adapter's settings (its scaling is no tensor) and every tensor of the
    state dict: its name, shape, dtype and every byte."""
    described = model.config.to_dict()
    lora = getattr(model, "lora_config", None)
    if lora is not None:
        described = {**described, "lora": lora.to_dict()}
    config = json.dumps(described, sort_keys=True, default=str)
    digest = hashlib.blake2b(config.encode(), digest_size=32)
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(f"\0{name}\0{tuple(tensor.shape)}\0{tensor.dtype}\0".encode())
        flat = tensor.detach().reshape(-1)
        for start in range(0, flat.numel(), _HASH_CHUNK):  # bounded host copies of GPU weights
            digest.update(flat[start : start + _HASH_CHUNK].contiguous().cpu().view(torch.uint8).numpy())
    return digest.hexdigest()


class FingerprintCache:
    """`model_fingerprint(model)`, computed again only after `clear()` (which `Engine.weights_changed`
    calls) or when a tensor was replaced or written in place (its storage or version counter moved)."""

    def __init__(self, model):
        self.model = model
        self._key: tuple | None = None
        self._value = ""

    def get(self) -> str:
        key = tuple((name, t.data_ptr(), _version(t)) for name, t in self.model.state_dict().items())
        if key != self._key:
            self._key, self._value = key, model_fingerprint(self.model)
        return self._value

    def clear(self) -> None:
        self._key = None


def _version(tensor: torch.Tensor) -> int:
    try:
        return tensor._version
    except RuntimeError:  # an inference tensor has no version counter; it changes only in inference mode
        return -1


@dataclass(frozen=True)
class SessionMemory:
    tokens: int  # tokens in the conversation
    cached_tokens: int  # of which K/V is in the pool
    pages: int
    shared_pages: int  # also held by the radix cache, a fork or a request
    bytes: int


class Session:
    """A conversation kept in `engine`'s pool; it reaches the engine only through its public methods."""

    def __init__(self, engine, ttl: float | None = None):
        self.engine, self.ttl = engine, ttl
        self.id = f"session-{next(_ids)}"
        self.tokens: list[int] = []
        self.pages: list[int] = []
        self.num_computed = 0
        self.last_logits: torch.Tensor | None = None  # (V,) when every token is computed
        self.kv_from_file = False  # its K/V derive from a loaded file: kept out of the radix cache
        self.expired = self.closed = False
        self._busy: str | None = None  # the id of the turn running now
        self.touch()

    # -- turns ----------------------------------------------------------------------------------------------
    def generate(self, prompt: Prompt | None = None, params: SamplingParams | None = None) -> Completion:
        """Append `prompt` (text or ids, may be empty) and generate a reply, which joins the session.

        If the turn fails (RequestError) or is interrupted, the session keeps its history without the turn.
        """
        handle = self.submit(prompt, params)
        try:
            handle.wait()
        except BaseException:
            handle.abort()
            raise
        [completion] = handle.result()
        return completion

    def stream(self, prompt: Prompt | None = None, params: SamplingParams | None = None) -> Iterator[Delta]:
        """Like `generate`, as deltas."""
        return self.engine.deltas(self.submit(prompt, params))

    def append(self, prompt: Prompt) -> None:
        """Add tokens without generating; they are computed now and the next-token logits kept."""
        self.generate(prompt, SamplingParams(max_tokens=0))

    def submit(self, prompt: Prompt | None = None, params: SamplingParams | None = None):
        """Queue a turn (safe from any thread); the engine's `RequestHandle` for it."""
        with self.engine.lock:
            self._check_usable()
            params = params or SamplingParams()
            if params.n != 1:
                raise SessionError(
                    f"a session continues one conversation, got SamplingParams.n={params.n}; use fork()"
                )
            return self.engine.submit(prompt if prompt is not None else [], params, session=self)

    def lend(self, request_id: str) -> tuple[list[int], int, torch.Tensor | None, bool]:
        """Hand this session's memory to its next turn (the engine calls this): pages, computed tokens,
        kept logits and whether its K/V come from a file. The session is busy until `end_turn`."""
        lent = self.pages, self.num_computed, self.last_logits, self.kv_from_file
        self.pages, self.last_logits, self._busy, self.expired = [], None, request_id, False
        return lent

    def end_turn(self, req: Request, pages: list[int], last_logits: torch.Tensor | None) -> None:
        """Take back the memory of this session's finished turn (the engine calls this, with the pages it
        kept for the session). A failed turn is dropped: the history stays, its pages went back."""
        self._busy = None
        if req.error is not None:
            self.pages, self.num_computed, self.last_logits, self.kv_from_file = [], 0, None, False
            return
        self.pages, self.kv_from_file = pages, req.kv_from_file
        self.tokens, self.num_computed = list(req.tokens), req.num_computed
        if last_logits is not None and self.num_computed == len(self.tokens):
            self.last_logits = last_logits.clone()
        assert self.num_computed < len(self.tokens) or self.last_logits is not None, "computed without logits"
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
            raise SessionError(f"{self.id} is running {self._busy}; it cannot expire mid-turn")
        self.engine.pool.release(self.pages)
        self.pages, self.num_computed, self.last_logits, self.expired = [], 0, None, True
        self.kv_from_file = False  # nothing of the file is left: the next turn recomputes

    def close(self) -> None:
        """Abort a running turn, release every page and forget the session."""
        with self.engine.lock:
            if self._busy is not None:
                self.engine.abort(self._busy)
            self._release()

    def _release(self) -> None:
        if not self.closed:
            self.engine.pool.release(self.pages)
            self.pages, self.closed = [], True
            self.engine.sessions.pop(self.id, None)

    def _check_usable(self) -> None:
        if self.closed:
            raise SessionError(f"{self.id} is closed; start a new one with engine.session()")
        if self._busy is not None:
            raise SessionError(f"{self.id} is running {self._busy}; wait for that turn to finish")

    # -- copies ---------------------------------------------------------------------------------------------
    def fork(self) -> Session:
        """An independent copy: full pages shared (copy-on-write), the partial page copied."""
        with self.engine.lock:
            self._check_usable()
            child = self.engine.session(self.ttl)
            child.tokens, child.kv_from_file = list(self.tokens), self.kv_from_file
            if "lora_binding" in self.__dict__:  # its K/V is the adapter's (adapters.bind_adapter)
                child.__dict__["lora_binding"] = self.__dict__["lora_binding"]
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

    def _refuse_state_op(self, what: str) -> None:
        if holds_states(self.engine.pool):  # an RWKV engine: the state is the engine's, shared by its slots
            raise SessionError(f"{self.id} holds its RWKV state in the engine's pool, where {what} does not reach "
                               f"it; {what} a state with astrai_pl.inference.StateSession (StateSession.{what})")

    def blend(self, other, alpha: float):
        """Refused: interpolation needs a fixed-size point per context (an RWKV state, StateSession.blend)."""
        self._refuse_state_op("blend")
        raise SessionError(
            f"{self.id} keeps its context as keys and values, one per token: two conversations of different "
            "lengths hold different numbers of them, and a mix of two tokens' K/V is no token's, so there is no "
            "state to interpolate; blending needs a recurrent model's fixed-size state (StateSession.blend)"
        )

    def scale(self, component: str, factor: float, layers=None):
        """Refused: editing scales parts of a recurrent state (StateSession.scale); K/V have no such parts."""
        self._refuse_state_op("scale")
        raise SessionError(
            f"{self.id} keeps keys and values per token, not a recurrent state with shifts and wkv sums; "
            "editing a component needs an RWKV session (StateSession.scale)"
        )

    def memory(self) -> SessionMemory:
        if holds_states(self.engine.pool):  # a recurrent engine (recurrent/pool.py): a held state, not pages
            return self.engine.pool.session_memory(self)
        refs, ps = self.engine.pool.allocator.refs, self.engine.page_size
        shared = sum(1 for p in self.pages if refs[p] > 1)
        per_token = self.engine.pool.storage.bytes_per_token
        return SessionMemory(
            len(self.tokens), self.num_computed, len(self.pages), shared, len(self.pages) * ps * per_token
        )

    def save(self, path: str | Path) -> None:
        """Write tokens, K/V of the computed tokens, last logits and the model fingerprint (safetensors); on an
        RWKV engine its state instead, in the state file format (`StatePool.save_session`)."""
        with self.engine.lock:
            self._check_usable()
            if self.__dict__.get("lora_binding", (None,))[0] is not None:
                raise SessionError(f"{self.id} runs on LoRA adapter {self.lora_binding[0]!r}, which a "
                                   "session file does not record; save sessions of the base model only")
            pool = self.engine.pool
            if holds_states(pool):
                return pool.save_session(self, path, self.engine.fingerprint.get())
            slots = torch.tensor(
                pool.slots(self.pages, 0, self.num_computed), dtype=torch.int64, device=pool.storage.k.device
            )
            k, v = pool.storage.read(slots)  # (layers, num_computed, Hkv, D)
            tensors = {"tokens": torch.tensor(self.tokens, dtype=torch.int64), "k": k.cpu(), "v": v.cpu()}
            if self.last_logits is not None:
                tensors["last_logits"] = self.last_logits.cpu()
            metadata = {
                "format": FORMAT,
                "version": VERSION,
                "fingerprint": self.engine.fingerprint.get(),
                "num_computed": str(self.num_computed),
            }
            save_file({name: t.contiguous() for name, t in tensors.items()}, str(path), metadata=metadata)


def load_session(engine, path: str | Path, ttl: float | None = None) -> Session:
    """Read a saved session into `engine`'s pool (the engine registers it). Everything read is checked
    before a page is taken, and a failure after that gives every page back. The pages stay the
    session's own: K/V from a file never enter the radix cache, where other requests would use them."""
    if holds_states(engine.pool):  # an RWKV engine: a state file (`StatePool.load_session`)
        return engine.pool.load_session(engine, path, ttl)
    tokens, computed, k, v, logits = _checked(engine, path, *_read(engine, path))
    session = Session(engine, ttl)
    session.tokens = tokens
    if computed:
        pool = engine.pool
        pages = pool.allocate(pool.pages_for(computed))
        if pages is None:
            raise CapacityError(
                f"{path} needs {pool.pages_for(computed)} free pages, the pool has "
                f"{pool.available()}; free memory or raise max_total_tokens"
            )
        try:
            slots = torch.tensor(
                pool.slots(pages, 0, computed), dtype=torch.int64, device=pool.storage.k.device
            )
            pool.storage.k[:, slots] = k[:, :computed].to(pool.storage.k)
            pool.storage.v[:, slots] = v[:, :computed].to(pool.storage.v)
        except BaseException:
            pool.release(pages)
            raise
        session.pages, session.num_computed, session.kv_from_file = pages, computed, True
    if logits is not None:
        session.last_logits = logits.to(engine.device, torch.float32)
    return session


def _read(engine, path: str | Path) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """The metadata and tensors of a session file, refused (SessionError) unless it is one for this model."""
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            _check_header(engine, path, metadata)
            return metadata, {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    except (SessionError, FileNotFoundError):
        raise
    except Exception as err:  # safetensors refuses a damaged or foreign file with its own error types
        raise SessionError(
            f"{path} is not a readable session file ({type(err).__name__}: {err}); pass a file written by "
            "Session.save"
        ) from err


def _check_header(engine, path, metadata: dict[str, str]) -> None:
    if metadata.get("format") != FORMAT:
        raise SessionError(
            f"{path} is not a saved session (format {metadata.get('format')!r}); pass a file written by Session.save"
        )
    if metadata.get("version") != VERSION:
        raise SessionError(
            f"{path} is a session file of version {metadata.get('version')!r}, this engine reads version "
            f"{VERSION}; save the session again with this version"
        )
    fingerprint = engine.fingerprint.get()
    if metadata.get("fingerprint") != fingerprint:
        raise SessionError(
            f"{path} was saved from a different model (fingerprint {metadata.get('fingerprint', '?')[:12]} "
            f"!= {fingerprint[:12]}); load it into an engine on the same weights and dtype, or start a new session"
        )


def file_refuser(path) -> Callable[[str], SessionError]:
    """The error for a session file whose content does not hold together: `what`, then the fix."""
    return lambda what: SessionError(f"{path}: {what}; the file is damaged or was edited, save the session again")


def holds_states(pool) -> bool:
    """Whether an engine's pool keeps one recurrent state per request (state_pool.StatePool), not K/V pages."""
    return hasattr(pool, "held")


def _checked(engine, path, metadata: dict[str, str], tensors: dict[str, torch.Tensor]):
    """tokens, positions to load, K, V and logits (or None), each checked against the engine."""
    refuse = file_refuser(path)
    names = set(tensors)
    if not {"tokens", "k", "v"} <= names <= {"tokens", "k", "v", "last_logits"}:
        raise refuse(f"holds the tensors {sorted(names)}, a session has tokens, k, v and maybe last_logits")
    tokens = _checked_tokens(engine, tensors["tokens"], refuse)
    count = metadata.get("num_computed", "")
    if not (count.isascii() and count.isdigit()) or int(count) > len(tokens):
        raise refuse(f"num_computed={count!r} is not a count of 0..{len(tokens)} tokens")
    computed = int(count)
    storage = engine.pool.storage.k
    expected = (storage.shape[0], computed, storage.shape[2], storage.shape[3])
    for name in ("k", "v"):
        t = tensors[name]
        if tuple(t.shape) != expected or t.dtype != storage.dtype:
            raise refuse(f"{name} is {t.dtype} {tuple(t.shape)}, expected {storage.dtype} {expected}")
        if not torch.isfinite(t).all():
            raise refuse(f"{name} holds NaN or inf")
    logits, vocab = tensors.get("last_logits"), engine.model.config.vocab_size
    if logits is not None:
        if computed != len(tokens) or tuple(logits.shape) != (vocab,) or not logits.dtype.is_floating_point:
            raise refuse(
                f"last_logits {logits.dtype} {tuple(logits.shape)} do not fit {computed} of {len(tokens)} "
                f"computed tokens and a vocabulary of {vocab}"
            )
        if not torch.isfinite(logits).all():
            raise refuse("last_logits hold NaN or inf")
    elif computed and computed == len(tokens):
        computed -= 1  # without the logits the last token is recomputed, so its K/V are not needed
    return tokens, computed, tensors["k"], tensors["v"], logits


def _checked_tokens(engine, tokens: torch.Tensor, refuse) -> list[int]:
    vocab = engine.model.config.vocab_size
    if tokens.dtype != torch.int64 or tokens.dim() != 1:
        raise refuse(f"tokens are {tokens.dtype} of shape {tuple(tokens.shape)}, not a 1-D int64 list")
    if tokens.numel() and not (int(tokens.min()) >= 0 and int(tokens.max()) < vocab):
        raise refuse(f"tokens hold ids outside the vocabulary of {vocab}")
    if tokens.numel() >= engine.max_context:
        raise refuse(f"{tokens.numel()} tokens fill this engine's context of {engine.max_context}")
    return tokens.tolist()
