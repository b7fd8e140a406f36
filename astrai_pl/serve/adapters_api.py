"""LoRA adapters over HTTP, as vLLM serves them: one base model and any number of adapters, each a model id.

    astrai-pl serve --model base/ --lora-modules sql=adapters/sql chat=adapters/chat
    POST /v1/load_lora_adapter     {"lora_name": "law", "lora_path": "adapters/law"}   (API key, when set)
    POST /v1/unload_lora_adapter   {"lora_name": "law"}

A request names its adapter as `model` (the base by the server's own model id); requests for different adapters
share batches (inference/adapters.py; which adapter a request names: lora_models.py). `GET /v1/models` lists the base and every adapter, whose `parent` is
the base's id. An adapter folder is untrusted: it is checked exactly as `--adapter` checks one, and a refused
folder answers 400 with the reason and the file. An adapter that queued or running requests use is not
unloaded: 409, retry when they finish.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from ..inference.adapters import AdapterInUseError, load_lora_adapter, unload_lora_adapter
from ..model.config import ConfigError
from ..model.hf_config import CheckpointError
from .bodies import parse_body
from .errors import APIError, bad_request
from .generation import read_json


class LoadAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    lora_name: str = Field(max_length=128)
    lora_path: str = Field(max_length=4096)


class UnloadAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    lora_name: str = Field(max_length=128)


def adapters_router(state) -> APIRouter:
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
