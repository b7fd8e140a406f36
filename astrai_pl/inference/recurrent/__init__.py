"""The recurrent (RWKV) side of inference, beside the K/V side: one fixed-size state per request instead of pages.

    runner.py   the engine's scheduler and runner over a state pool (Engine picks them for an RWKV model)
    pool.py     StatePool: state slots, page-boundary snapshots in the radix cache, held session states
    session.py  StateSession / StateStore: a state kept, forked, saved, blended and edited over the model itself
    ops.py      the state operations (blend, scale, inspect, distance), pure functions on LayerState lists
    files.py    the state file format (safetensors, checked on load)
"""

from .runner import build_recurrent, is_recurrent
from .session import StateSession, StateStore, generate_batch

__all__ = ["StateSession", "StateStore", "build_recurrent", "generate_batch", "is_recurrent"]
