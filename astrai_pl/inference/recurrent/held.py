"""The state operations (ops.py) on engine sessions of an RWKV engine, whose states the `StatePool` holds.

    blended = blend_held(a, b, 0.3)        # a new engine session on (1 − 0.3)·a + 0.3·b
    scale_held(a, "history", 0.5, [1])     # a's state edited in place
    inspect_held(a), held_distance(a, b)   # per-layer magnitudes and divergence (ops.StateReport)

Each needs its sessions idle and every token computed (`needs_flush` says when the last reply token is still
pending: one prefill-only turn with no new tokens computes it). A blended or edited state no longer follows
from the session's tokens, so it is marked like a state read from a file (`kv_from_file`): it never enters the
prefix cache, and it has no next-token logits (no token produced it), so its next turn must bring tokens.
Attention sessions keep K/V per token, not a state: `refuse_attention` says why each operation is refused.
"""

from __future__ import annotations

import torch

from ...model.rwkv import LayerState
from ..sessions import Session, SessionError, holds_states
from .ops import blend_layers, check_edit, scale_layers, state_distance, state_stats

WHY_NOT = {
    "blend": "a mix of two conversations' per-token keys and values is no token's, and conversations of "
             "different lengths hold different numbers of them",
    "scale": "keys and values per token have no token shifts or wkv sums to scale",
    "inspect": "its memory is keys and values per token, which grow with the context; GET the session for "
               "its tokens, pages and bytes",
    "distance": "two conversations' per-token keys and values are not points of one space",
}


def is_recurrent_session(session: Session) -> bool:
    return holds_states(session.engine.pool)


def refuse_attention(session: Session, what: str) -> None:
    """SessionError for `what` (a key of WHY_NOT) on an attention engine's session; nothing on an RWKV one."""
    if not is_recurrent_session(session):
        raise SessionError(f"{what} works on an RWKV model's fixed-size recurrent state; this model keeps "
                           f"attention K/V: {WHY_NOT[what]}")


def needs_flush(session: Session) -> bool:
    """Whether the session's last token is pending (a turn's final reply token is computed by the next)."""
    return session.num_computed < len(session.tokens)


def held_layers(session: Session) -> list[LayerState]:
    """The session's state as one-row LayerStates (copies; the zero state before any token)."""
    refuse_attention(session, "inspect")
    session._check_usable()
    if needs_flush(session):
        raise SessionError(f"{session.id} has {len(session.tokens) - session.num_computed} token(s) not computed "
                           "into its state; run a turn with max_tokens=0 first")
    pool = session.engine.pool
    held = pool.held[session.pages[0]] if session.pages else pool.zero_state()
    return [LayerState(*(t[i : i + 1].clone() for t in held)) for i in range(held[0].shape[0])]


def _put(session: Session, layers: list[LayerState]) -> None:
    """Hold `layers` as the session's state, every token computed, no logits, kept out of the prefix cache."""
    pool = session.engine.pool
    state = [torch.cat(parts).to(rows) for rows, parts in zip(pool.rows, zip(*layers))]  # each (layers, H)
    if session.pages:
        pool.release(session.pages)
    handle = pool.hold_state(state)
    session.pages, session.num_computed = [handle], len(session.tokens)
    session.last_logits, session.kv_from_file = None, True
    session.touch()


def blend_held(session: Session, other: Session, alpha: float) -> Session:
    """A new session of the same engine on (1 − α)·session + α·other (ops.blend_layers); its tokens are
    `session`'s. α = 0 gives session's state, 1 other's."""
    refuse_attention(session, "blend")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha <= 1:
        raise ValueError(f"alpha={alpha!r} must be a number in [0, 1] (0: this state, 1: the other); outside "
                         "it the wkv denominator could turn negative")
    engine = session.engine
    if other.engine is not engine:
        raise SessionError(f"blend: {other.id} belongs to another engine than {session.id}")
    with engine.lock:
        mixed = blend_layers(held_layers(session), held_layers(other), float(alpha))
        child = engine.session(session.ttl)
        child.tokens = list(session.tokens)
        _put(child, mixed)
        return child


def scale_held(session: Session, component: str, factor: float, layers: list[int] | None = None) -> None:
    """Multiply `component` (ops.EDITABLE) by `factor` in `layers` (all by default) of the session's state."""
    refuse_attention(session, "scale")
    which = check_edit(component, factor, layers, session.engine.model.config.num_hidden_layers)
    with session.engine.lock:
        _put(session, scale_layers(held_layers(session), component, float(factor), which))


def inspect_held(session: Session):
    """Per layer and component, mean |x|, max |x| and L2 (ops.state_stats)."""
    refuse_attention(session, "inspect")
    with session.engine.lock:
        return state_stats(held_layers(session))


def held_distance(session: Session, other: Session):
    """Per layer and component, L2 and cosine between the two sessions' states (ops.state_distance)."""
    refuse_attention(session, "distance")
    if other.engine is not session.engine:
        raise SessionError(f"distance: {other.id} belongs to another engine than {session.id}")
    with session.engine.lock:
        return state_distance(held_layers(session), held_layers(other))
