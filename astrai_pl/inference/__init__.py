"""Inference: paged KV cache, radix prefix cache, continuous batching, sampling, streaming and sessions.

    from astrai_pl.inference import Engine, SamplingParams
    engine = Engine(model, tokenizer)
    [completion] = engine.generate("Once upon a time", SamplingParams(max_tokens=32, temperature=0))

See docs/inference.md for the design.
"""

from .admission import PromptError
from .backends import (
    BACKEND_NAMES,
    FLASH_ATTN_AVAILABLE,
    BackendUnavailable,
    StepView,
    attn_backend,
    available_backends,
    select_backend,
)
from .cache import CapacityError, InferenceError, KVStorage, PageAllocator, ReqToTokenPool
from .engine import Engine, EngineConfigError, EngineStats
from .pool import KVPool, PoolUsage
from .radix import RadixCache
from .request import Completion, Delta, RequestError
from .sampling import SamplingParams, SamplingParamsError, sample
from .sessions import Session, SessionError, SessionMemory, model_fingerprint
from .text import TextStream

__all__ = [
    "BACKEND_NAMES",
    "FLASH_ATTN_AVAILABLE",
    "BackendUnavailable",
    "CapacityError",
    "Completion",
    "Delta",
    "Engine",
    "EngineConfigError",
    "EngineStats",
    "InferenceError",
    "KVPool",
    "KVStorage",
    "PageAllocator",
    "PoolUsage",
    "PromptError",
    "RadixCache",
    "ReqToTokenPool",
    "RequestError",
    "SamplingParams",
    "SamplingParamsError",
    "Session",
    "SessionError",
    "SessionMemory",
    "StepView",
    "TextStream",
    "attn_backend",
    "available_backends",
    "model_fingerprint",
    "sample",
    "select_backend",
]
