"""LoRA adapters served side by side on one engine: loaded and unloaded at run time, chosen per request.

    load_lora_adapter(engine, "sql", "adapters/sql")           # PEFT directory, checked as --adapter is
    engine.generate(prompts, SamplingParams(lora_name="sql"))  # lora_name None: the base
    unload_lora_adapter(engine, "sql")                         # refused while requests run on it

Requests for different adapters share every step (model/multi_lora.py computes each row's adapter). The prefix
cache keeps them apart: an adapter's requests are cached under a salt of their own (the adapter's name and load
slot, then the request's own salt), so K/V computed under one adapter (or under the base) is never reused by
another, nor by the same name loaded again from another folder. A session is bound to the adapter of its first
turn; a later turn naming another one is refused.

An adapter in use is not unloaded: `unload_lora_adapter` raises `AdapterInUseError` while a request for it is
queued or running, so the caller retries once they finish (the server answers 409). A session bound to an
unloaded adapter refuses its next turn. CUDA-graph decode replay is turned off when the first adapter loads
(recorded graphs would not see the per-row adapters), with one log line. Recurrent (RWKV) engines are refused.
"""

from __future__ import annotations

import contextlib
import copy
import logging

from ..model.multi_lora import LoadedAdapter, LoraSet, read_checked
from .cache import InferenceError
from .request import Request
from .sampling import SamplingParamsError

log = logging.getLogger("astrai_pl.inference")


class AdapterInUseError(InferenceError):
    """An adapter cannot be unloaded: requests for it are queued or running."""


def lora_adapters(engine) -> dict[str, LoadedAdapter]:
    """The adapters loaded on `engine`, by name."""
    found = LoraSet.of(engine.model)
    return {} if found is None else dict(found.adapters)


def load_lora_adapter(engine, name: str, path) -> LoadedAdapter:
    """Load the PEFT adapter directory `path` as `name` (CheckpointError naming the file and the problem; the
    engine is unchanged when it is refused)."""
    if getattr(engine.model.config, "mixer", "attention") == "rwkv":
        raise InferenceError("several LoRA adapters per batch are served on attention models only; merge the "
                             "adapter into the RWKV model (astrai-pl convert --merge-lora) and serve that")
    LoraSet.of(engine.model, create=True).check_name(name)
    checked = read_checked(engine.model, path)  # outside the lock: steps go on while the files are read
    with engine.lock:
        loaded = LoraSet.of(engine.model).add(name, path, checked)
        if getattr(engine.runner, "graphs", None) is not None:
            engine.runner.graphs = None
            log.info("decode steps run eagerly from now on: recorded CUDA graphs cannot choose adapters per row")
        return loaded


def unload_lora_adapter(engine, name: str) -> LoadedAdapter:
    """Unload adapter `name`: KeyError when none is loaded so, AdapterInUseError while requests use it."""
    with engine.lock:
        found = LoraSet.of(engine.model)
        if found is None or name not in found.adapters:
            raise KeyError(name)
        busy = sum(1 for req in engine._requests.values() if req.params.lora_name == name)
        if busy:
            raise AdapterInUseError(f"adapter {name!r} serves {busy} queued or running request(s); unload it "
                                    "once they finish")
        return found.remove(name)


def bind_adapter(engine, req: Request, session=None) -> None:
    """Give `req` the cache salt of its adapter (in a copy of its params) and bind a session to its adapter;
    SamplingParamsError for an adapter not loaded, or a session turn naming another adapter than its first."""
    params = req.params
    name = params.lora_name
    loaded = lora_adapters(engine).get(name) if name is not None else None
    if name is not None and loaded is None:
        raise SamplingParamsError(f"SamplingParams.lora_name={name[:80]!r}: no such adapter is loaded; load it "
                                  f"first (loaded: {sorted(lora_adapters(engine))[:8]})")
    slot = None if loaded is None else loaded.slot
    if session is not None:
        bound = session.__dict__.setdefault("lora_binding", (name, slot))
        if bound != (name, slot):
            was = "the base model" if bound[0] is None else f"adapter {bound[0]!r} (load slot {bound[1]})"
            raise SamplingParamsError(f"SamplingParams.lora_name={name!r}: this session's K/V was computed by "
                                      f"{was}; continue it with that model, or start a new session")
    salt = adapter_salt(name, slot, params.cache_salt)
    if salt != params.cache_salt:
        req.params = copy.copy(params)
        req.params.cache_salt = salt


def bind_session(engine, session, name: str | None) -> None:
    """Bind a new `session` to adapter `name` (None: the base) before its first turn."""
    loaded = lora_adapters(engine).get(name) if name is not None else None
    if name is not None and loaded is None:
        raise SamplingParamsError(f"SamplingParams.lora_name={name[:80]!r}: no such adapter is loaded")
    session.__dict__["lora_binding"] = (name, None if loaded is None else loaded.slot)


def session_adapter(session) -> str | None:
    """The adapter `session` is bound to (None: the base, or no turn yet)."""
    return session.__dict__.get("lora_binding", (None, None))[0]


def adapter_salt(name: str | None, slot: int | None, own: str | None) -> str | None:
    """The prefix-cache salt of a request for adapter `name` (None: the base) with its own salt `own`. Adapter
    salts begin with "lora:"; a base salt that could be mistaken for one (or for an escaped one) is escaped
    with "base:", so no two (adapter, own salt) pairs share a salt."""
    if name is not None:
        return f"lora:{slot}:{name}|{own or ''}"
    if own is not None and own.startswith(("lora:", "base:")):
        return "base:" + own
    return own


def step_rows(model, plan: list[tuple[Request, int]]):
    """The context a forward over `plan` runs in: each token's adapter (a no-op without adapters)."""
    found = LoraSet.of(model)
    if found is None or not found.adapters:
        return contextlib.nullcontext()
    return found.rows([req.params.lora_name for req, _ in plan], [n for _, n in plan])
