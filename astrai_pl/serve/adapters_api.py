"""LoRA adapters over HTTP, as vLLM serves them: one base model and any number of adapters, each a model id.

    astrai-pl serve --model base/ --lora-modules sql=adapters/sql chat=adapters/chat
    POST /v1/load_lora_adapter     {"lora_name": "law", "lora_path": "adapters/law"}   (API key, when set)
    POST /v1/unload_lora_adapter   {"lora_name": "law"}

A request names its adapter as `model` (the base by the server's own model id); requests for different adapters
share batches (inference/adapters.py). `GET /v1/models` lists the base and every adapter, whose `parent` is
the base's id. An adapter folder is untrusted: it is checked exactly as `--adapter` checks one, and a refused
folder answers 400 with the reason and the file. An adapter that queued or running requests use is not
unloaded: 409, retry when they finish.
"""

from __future__ import annotations

import json

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from ..inference.adapters import AdapterInUseError, load_lora_adapter, lora_adapters, unload_lora_adapter
from ..model.config import ConfigError
from ..model.hf_config import CheckpointError
from .bodies import parse_body
from .errors import APIError, bad_request


class LoadAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    lora_name: str = Field(max_length=128)
    lora_path: str = Field(max_length=4096)


class UnloadAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    lora_name: str = Field(max_length=128)


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


def adapters_router(state) -> APIRouter:
    from .generation import read_json  # generation routes calls through route_to_adapter, above

    router = APIRouter(prefix="/v1")

    @router.post("/load_lora_adapter")
    async def load(request: Request) -> PlainTextResponse:
        req = parse_body(await read_json(request), LoadAdapterRequest)
        if req.lora_name == state.model_name:
            raise bad_request(f"'{req.lora_name}' is the base model's id; pick another lora_name", "lora_name")
        try:
            await state.off_loop(load_lora_adapter, state.engine, req.lora_name, req.lora_path)
        except (CheckpointError, ConfigError, OSError) as err:
            raise bad_request(f"adapter '{req.lora_name}' not loaded: {err}", "lora_path") from None
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @router.post("/unload_lora_adapter")
    async def unload(request: Request) -> PlainTextResponse:
        req = parse_body(await read_json(request), UnloadAdapterRequest)
        try:
            unload_lora_adapter(state.engine, req.lora_name)
        except KeyError:
            raise APIError(404, f"no adapter named '{req.lora_name[:80]}' is loaded (GET /v1/models)",
                           param="lora_name", code="model_not_found") from None
        except AdapterInUseError as err:
            raise APIError(409, str(err), param="lora_name", code="adapter_in_use") from None
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    return router
