"""Which adapter a request names: the model ids of a server with LoRA adapters (`--lora-modules`).

The base answers to the server's own id; every adapter loaded on the engine (inference/adapters.py) to its
name. `GET /v1/models` shows each adapter with `parent`, the base's id, as vLLM does.
"""

from __future__ import annotations

import json

from ..inference.adapters import lora_adapters


def parse_lora_module(text: str) -> tuple[str, str]:
    """One `--lora-modules` value: `name=DIR`, or vLLM's JSON form `{"name": …, "path": …}`; ValueError saying
    which form is expected."""
    if text.lstrip().startswith("{"):
        try:
            spec = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"--lora-modules {text[:80]!r}: not valid JSON ({err.msg})") from None
        if not (isinstance(spec, dict) and isinstance(spec.get("name"), str) and isinstance(spec.get("path"), str)):
            raise ValueError(f"--lora-modules {text[:80]!r}: the JSON form needs string 'name' and 'path'")
        return spec["name"], spec["path"]
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules {text[:80]!r}: give name=DIR (or JSON: "
                         '\'{"name": "sql", "path": "adapters/sql"}\')')
    return name, path


def adapter_name(state, model: str | None) -> str | None:
    """The adapter a request's `model` names (None: the base or no model given). Checked by `check_model`
    before; an adapter unloaded since is refused when the request is submitted, never served by the base."""
    return None if model is None or model == state.model_name else model


def route_to_adapter(state, call, raw) -> None:
    """Send a parsed call to the adapter its body's `model` names, and answer under that id."""
    model = raw.get("model") if isinstance(raw, dict) else None
    if isinstance(model, str):
        call.params.lora_name = adapter_name(state, model)
    if call.params.lora_name is not None:
        call.model = call.params.lora_name


def adapter_cards(state, created: int) -> list[dict]:
    return [{"id": name, "object": "model", "created": created, "owned_by": "astrai_pl", "root": loaded.path,
             "parent": state.model_name, "max_model_len": state.context_len}
            for name, loaded in lora_adapters(state.engine).items()]
