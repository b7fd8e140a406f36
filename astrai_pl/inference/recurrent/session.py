"""RWKV sessions: a conversation's whole context in a fixed-size recurrent state, and what one does with it.

    chat = StateSession.warm(model, "Facts: ...", tokenizer)   # warm state: the context is prefilled once
    a, b = chat.fork(), chat.fork()        # shared state: both start on chat's tensors, nothing copied
    a.generate(" Q1?", params)             # continues from the state: only the new tokens are computed
    chat.save("chat.safetensors", dtype=torch.float16)   # constant size, whatever the context length
    StateSession.load("chat.safetensors", model, tokenizer)
    mix = a.blend(b, 0.3)                  # (1 − 0.3)·a + 0.3·b, on the unscaled wkv sums
    a.scale("history", 0.5, layers=[1])    # edit: fade layer 1's memory of everything so far
    a.inspect(), a.distance(b)             # per-layer magnitudes, per-layer divergence
    generate_batch([a, b], [" x", " y"], params)   # independent states, one batched forward per step
    store = StateStore(model, tokenizer, ttl=600)  # many sessions by id, expired by a monotonic clock

Shared states are copy-on-write by construction: a forward never writes into the state it starts from (it
builds the next one, rwkv.py), and no operation here writes into a tensor either, so forks share their
parent's tensors until one of them moves on, and then only that one gets new tensors.

A turn's last sampled token is kept pending, not computed, like the attention sessions' last reply token: the
next turn computes it with its prompt. Operations on the state itself (save, blend, scale, inspect, distance)
compute it first. The model is called as it is (no mode change, no gradients).
"""

from __future__ import annotations

import math
import sys
import threading
import time
from itertools import count

import torch

from ...model.rwkv import RwkvState
from ..admission import check_params, checked_constraint, params_per_prompt, prompt_token_ids, text_stream
from ..cache import CapacityError
from ..request import Completion, Request, end_ids
from ..sampling import SamplingParams, sample
from ..sessions import FingerprintCache, SessionError
from .files import read_state, write_state
from .ops import (
    blend_layers,
    check_edit,
    layers_of,
    row_of,
    rows_of,
    scale_layers,
    stack_states,
    state_distance,
    state_stats,
)
from .runner import is_recurrent

_ids = count()


class StateSession:
    """One conversation over an RWKV `model`: its state (one row), its token count and, when every token is
    computed, the next-token logits."""

    def __init__(self, model, tokenizer=None, *, fingerprint: FingerprintCache | None = None):
        if not is_recurrent(model):
            raise SessionError(f"StateSession needs a recurrent (rwkv) model, got model_type="
                               f"{model.config.model_type!r}; attention models keep sessions in the engine "
                               "(engine.session())")
        self.model, self.tokenizer = model, tokenizer
        self.id = f"state-{next(_ids)}"
        self.state = RwkvState()  # zero state: the forward starts from zeros
        self.num_tokens = 0  # tokens the state stands for, the pending one included
        self.pending: list[int] = []  # the last turn's final token, not yet computed
        self.last_logits: torch.Tensor | None = None  # (V,) float32 after the last computed token
        self.computed_tokens = 0  # tokens this session has run through the model since it was made
        self.fingerprint = fingerprint or FingerprintCache(model)

    @classmethod
    def warm(cls, model, context, tokenizer=None, **kwargs) -> StateSession:
        """A session whose state has read `context` (text or ids): prefill once, reuse with `fork`."""
        session = cls(model, tokenizer, **kwargs)
        session.append(context)
        return session

    # -- turns ----------------------------------------------------------------------------------------------
    def generate(self, prompt=None, params: SamplingParams | None = None) -> Completion:
        """Read `prompt` (text or ids, may be empty) from the state and continue it; the reply joins it."""
        return generate_batch([self], [prompt], params)[0]

    def append(self, prompt) -> None:
        """Read tokens without generating; the next-token logits are kept."""
        self.generate(prompt, SamplingParams(max_tokens=0))

    def flush(self) -> None:
        """Compute the pending token, so the state stands for every token."""
        if self.pending:
            self.append([])

    # -- copies ---------------------------------------------------------------------------------------------
    def _derived(self, layers, num_tokens: int) -> StateSession:
        child = StateSession(self.model, self.tokenizer, fingerprint=self.fingerprint)
        child.state, child.num_tokens = RwkvState(list(layers)), num_tokens
        return child

    def fork(self) -> StateSession:
        """An independent session on the same state, its tensors shared until either session changes."""
        child = self._derived(self.state.layers, self.num_tokens)
        child.pending, child.last_logits = list(self.pending), self.last_logits
        return child

    def blend(self, other: StateSession, alpha: float) -> StateSession:
        """A new session on (1 − α)·self + α·other: the shifts interpolated linearly, the wkv numerator and
        denominator as unscaled sums at a common exponent (`state_ops.blend_layers`). α = 0 gives self's state,
        1 other's. It has no next-token logits (no token produced it): continue it with a prompt."""
        self._check_partner(other, "blend")
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha <= 1:
            raise ValueError(f"alpha={alpha!r} must be a number in [0, 1] (0: this state, 1: the other); "
                             "outside it the denominator could turn negative")
        layers = blend_layers(self.layers(), other.layers(), float(alpha))
        return self._derived(layers, max(self.num_tokens, other.num_tokens))

    # -- the state as a value -------------------------------------------------------------------------------
    def layers(self):
        """Every layer's state (one row each), the pending token computed; zeros for a fresh session."""
        self.flush()
        return layers_of(self.model, self.state.layers)

    def scale(self, component: str, factor: float, layers: list[int] | None = None) -> StateSession:
        """Multiply one component (`state_ops.EDITABLE`: ffn_shift, att_shift, aa, bb, or history for a and b
        together) by `factor` in `layers` (all by default). The kept logits belong to the old state and go."""
        which = check_edit(component, factor, layers, self.model.config.num_hidden_layers)
        self.state = RwkvState(scale_layers(self.layers(), component, float(factor), which))
        self.last_logits = None
        return self

    def inspect(self):
        """Per layer and component, mean |x|, max |x| and L2 of the shifts and of the unscaled a and b."""
        return state_stats(self.layers())

    def distance(self, other: StateSession):
        """Per layer and component, L2 and cosine between this state and `other` (`state_ops.state_distance`)."""
        self._check_partner(other, "distance")
        return state_distance(self.layers(), other.layers())

    @property
    def nbytes(self) -> int:
        """Bytes of the state in memory: 5 × layers × hidden numbers, however long the context."""
        return sum(t.numel() * t.element_size() for layer in layers_of(self.model, self.state.layers) for t in layer)

    def _check_partner(self, other, what: str) -> None:
        if not isinstance(other, StateSession):
            raise SessionError(f"{what} takes another StateSession, got {type(other).__name__}")
        if other.model is not self.model:
            raise SessionError(f"{what}: {other.id} runs on another model than {self.id}; states of different "
                               "models do not share a space")

    # -- files ----------------------------------------------------------------------------------------------
    def save(self, path, dtype: torch.dtype = torch.float32) -> None:
        """Write the state, its next-token logits and a header (model fingerprint, layout version, dtype, token
        count) to safetensors; float16 / bfloat16 compress it (files.py). The pending token is computed
        first, so the file's size depends only on the model."""
        write_state(path, self.layers(), self.last_logits, self.fingerprint.get(), self.num_tokens, dtype)

    @classmethod
    def load(cls, path, model, tokenizer=None, **kwargs) -> StateSession:
        """A session from a file written by `save` for this very model; SessionError naming the file and the
        field otherwise (another model, another shape, a damaged file, NaN or inf)."""
        session = cls(model, tokenizer, **kwargs)
        config = model.config
        layers, logits, tokens = read_state(path, session.fingerprint.get(), config.num_hidden_layers,
                                            config.hidden_size, config.vocab_size)
        weight = model.embed_tokens.weight
        session.state = RwkvState([
            layer._replace(ffn_shift=layer.ffn_shift.to(weight), att_shift=layer.att_shift.to(weight),
                           aa=layer.aa.to(weight.device), bb=layer.bb.to(weight.device), pp=layer.pp.to(weight.device))
            for layer in layers])
        session.num_tokens = tokens
        session.last_logits = None if logits is None else logits.to(weight.device)
        return session


# -- batches ------------------------------------------------------------------------------------------------
def generate_batch(sessions: list[StateSession], prompts: list, params=None) -> list[Completion]:
    """Continue each session from its own state with its prompt, stepping all of them in one batched forward
    per token (prompts of equal length are prefilled together). Each completes as it would alone; every
    session is updated only once all have finished, so a failure leaves every one as it was."""
    if len(prompts) != len(sessions):
        raise ValueError(f"got {len(prompts)} prompts for {len(sessions)} sessions; pass one each")
    if not sessions:
        return []
    first = sessions[0]
    for s in sessions:
        first._check_partner(s, "generate_batch")
    if len({id(s) for s in sessions}) != len(sessions):
        raise SessionError("generate_batch got the same session twice; fork() it for a second continuation")
    turns = [_Turn(s, prompt, p) for s, prompt, p in zip(sessions, prompts, params_per_prompt(params, len(sessions)))]
    with torch.no_grad():
        _prefill(first.model, turns)
        _decode(first.model, turns, end_ids(first.model, first.tokenizer))
    for turn in turns:
        turn.commit()
    return [turn.request.completion() for turn in turns]


class _Turn:
    """One session's part of a batch: what it reads, its request (stop rules, text, logprobs) and its new
    state, logits and pending token, applied to the session by `commit`."""

    def __init__(self, session: StateSession, prompt, params: SamplingParams):
        model, tokenizer = session.model, session.tokenizer
        check_params(params, model.config.vocab_size, tokenizer is not None)
        if params.n != 1:
            raise SessionError(f"a session continues one conversation, got SamplingParams.n={params.n}; use fork()")
        if params.prompt_logprobs is not None:
            raise SessionError("prompt_logprobs: a state session does not score its prompt; use Engine.generate")
        ids = prompt_token_ids(prompt if prompt is not None else [], tokenizer, model.config.vocab_size)
        self.session, self.feed = session, session.pending + ids
        if not self.feed and session.last_logits is None and params.max_tokens:
            raise SessionError(f"{session.id} has no next-token logits (a fresh, blended, edited or loaded-empty "
                               "state); pass a prompt to continue it")
        self.request = Request(f"{session.id}-turn", ids, params, text_stream(tokenizer, params), device=_device(model))
        self.request.constraint = checked_constraint(params, tokenizer, model.config.vocab_size,
                                                     end_ids(model, tokenizer))
        self.layers, self.logits, self.pending = session.state.layers, session.last_logits, []

    def commit(self) -> None:
        s, req = self.session, self.request
        s.state, s.pending = RwkvState(list(self.layers)), self.pending
        s.last_logits = None if self.pending else self.logits
        s.num_tokens += len(req.prompt_ids) + len(req.output_ids)
        s.computed_tokens += self.computed


def _prefill(model, turns: list[_Turn]) -> None:
    """Run every turn's tokens through its state, turns of equal length in one forward."""
    by_length: dict[int, list[_Turn]] = {}
    for turn in turns:
        turn.computed = len(turn.feed)
        if turn.feed:
            by_length.setdefault(len(turn.feed), []).append(turn)
    for group in by_length.values():
        state = stack_states([layers_of(model, t.layers) for t in group])
        ids = torch.tensor([t.feed for t in group], device=_device(model))
        logits = model(ids, cache=state).logits[:, -1].float()  # (N, V)
        for row, turn in enumerate(group):
            turn.layers, turn.logits = row_of(state, row), logits[row].clone()


def _decode(model, turns: list[_Turn], stop_ids: set[int]) -> None:
    """Sample every running turn's next token together and feed those that go on, one batched step each."""
    running = []
    for turn in turns:
        if turn.request.params.max_tokens == 0:
            turn.request.finish_reason = "length"
        else:
            running.append(turn)
    if not running:
        return
    state = stack_states([layers_of(model, t.layers) for t in running])
    logits = torch.stack([t.logits for t in running])
    while running:
        reqs = [t.request for t in running]
        tokens, chosen, top = sample(logits, [r.params for r in reqs], [r.tokens for r in reqs],
                                     [len(r.output_ids) for r in reqs], [r.seed for r in reqs],
                                     [r.constraint for r in reqs])
        going = []
        for row, (turn, token) in enumerate(zip(running, tokens)):
            _, reason = turn.request.append(token, None if chosen is None else chosen[row], stop_ids, sys.maxsize,
                                            None if top is None else top[row])
            if reason is None:
                going.append(row)
                continue
            turn.request.finish_reason = reason
            turn.layers, turn.pending = row_of(state, row), [token]
        if not going:
            return
        if len(going) < len(running):
            state = rows_of(state, torch.tensor(going, device=_device(model)))
        running = [running[row] for row in going]
        ids = torch.tensor([[tokens[row]] for row in going], device=_device(model))
        logits = model(ids, cache=state).logits[:, -1].float()
        for turn in running:
            turn.computed += 1


def _device(model) -> torch.device:
    return model.embed_tokens.weight.device


# -- many sessions ------------------------------------------------------------------------------------------
class StateStore:
    """Sessions by id over one model, each expiring `ttl` seconds after its last use (None: never), at most
    `max_sessions` at once. Time is `clock()` (monotonic) unless a call passes `now`. A full store refuses a new
    id rather than drop a live session: expired ones go first, then CapacityError. The store may be used from
    several threads; each session, from one at a time."""

    def __init__(self, model, tokenizer=None, *, ttl: float | None = 3600.0, max_sessions: int = 1024,
                 clock=time.monotonic):
        if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not ttl > 0
                                or not math.isfinite(ttl)):
            raise ValueError(f"ttl={ttl!r} must be a number of seconds > 0, or None to keep sessions forever")
        if isinstance(max_sessions, bool) or not isinstance(max_sessions, int) or max_sessions < 1:
            raise ValueError(f"max_sessions={max_sessions!r} must be an int >= 1")
        self.model, self.tokenizer, self.ttl, self.max_sessions, self.clock = (
            model, tokenizer, ttl, max_sessions, clock)
        self.fingerprint = FingerprintCache(model)
        self._entries: dict[str, tuple[StateSession, float]] = {}  # id -> (session, last use)
        self._lock = threading.Lock()

    def start(self, session_id: str, context=None, *, now: float | None = None) -> StateSession:
        """A new session under `session_id`: a zero state, or a warm one that has read `context`."""
        session = StateSession(self.model, self.tokenizer, fingerprint=self.fingerprint)
        if context is not None:
            session.append(context)
        self.put(session_id, session, now=now)
        return session

    def load(self, session_id: str, path, *, now: float | None = None) -> StateSession:
        session = StateSession.load(path, self.model, self.tokenizer, fingerprint=self.fingerprint)
        self.put(session_id, session, now=now)
        return session

    def put(self, session_id: str, session: StateSession, *, now: float | None = None) -> None:
        if not isinstance(session_id, str) or not session_id:
            raise ValueError(f"session_id={session_id!r} must be a non-empty string")
        if not isinstance(session, StateSession) or session.model is not self.model:
            raise SessionError(f"{session_id}: the store keeps StateSessions on its own model")
        now = self._now(now)
        with self._lock:
            if session_id not in self._entries and len(self._entries) >= self.max_sessions:
                self._sweep(now)
                if len(self._entries) >= self.max_sessions:
                    raise CapacityError(f"the store holds max_sessions={self.max_sessions} live sessions; close "
                                        "one (pop), wait for one to expire, or raise max_sessions")
            self._entries[session_id] = (session, now)

    def get(self, session_id: str, *, now: float | None = None) -> StateSession | None:
        """The session (its clock restarted), or None if there is none or it has expired (then it is dropped)."""
        now = self._now(now)
        with self._lock:
            entry = self._entries.get(session_id)
            if entry is None:
                return None
            if self._expired(entry[1], now):
                del self._entries[session_id]
                return None
            self._entries[session_id] = (entry[0], now)
            return entry[0]

    def pop(self, session_id: str) -> StateSession | None:
        with self._lock:
            entry = self._entries.pop(session_id, None)
        return None if entry is None else entry[0]

    def sweep(self, *, now: float | None = None) -> list[str]:
        """Drop every expired session; their ids."""
        now = self._now(now)
        with self._lock:
            return self._sweep(now)

    def _sweep(self, now: float) -> list[str]:
        gone = [sid for sid, (_, used) in self._entries.items() if self._expired(used, now)]
        for sid in gone:
            del self._entries[sid]
        return gone

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, session_id) -> bool:
        entry = self._entries.get(session_id)
        return entry is not None and not self._expired(entry[1], self._now(None))

    def _now(self, now: float | None) -> float:
        return self.clock() if now is None else now

    def _expired(self, used: float, now: float) -> bool:
        return self.ttl is not None and now - used >= self.ttl
