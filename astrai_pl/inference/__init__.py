"""Inference: paged KV cache, radix prefix cache, continuous batching, sampling, streaming and sessions.

    from astrai_pl.inference import Engine, SamplingParams
    engine = Engine(model, tokenizer)
    [completion] = engine.generate("Once upon a time", SamplingParams(max_tokens=32, temperature=0))

    with engine:                                  # a background loop steps the batch
        handle = engine.submit("Hello", params)   # from any thread; iterate or `async for` its deltas

The internals (KVPool, RadixCache, KVStorage, StepView, the attention backends, sample, …) are imported
from their modules. See docs/inference.md for the design.
"""

from .admission import PromptError
from .attention import BackendUnavailable
from .cache import CapacityError, InferenceError
from .constraints import GrammarError, StructuredOutput
from .engine import Engine, EngineConfigError, EngineStats
from .handle import RequestHandle
from .recurrent import StateSession, StateStore, generate_batch
from .request import Completion, Delta, RequestError
from .sampling import SamplingParams, SamplingParamsError
from .sessions import Session, SessionError, SessionMemory
from .speculative import SpeculativeConfig

__all__ = [
    "BackendUnavailable",
    "GrammarError",
    "StructuredOutput",
    "CapacityError",
    "Completion",
    "Delta",
    "Engine",
    "EngineConfigError",
    "EngineStats",
    "InferenceError",
    "PromptError",
    "RequestError",
    "RequestHandle",
    "SamplingParams",
    "SamplingParamsError",
    "Session",
    "SessionError",
    "SessionMemory",
    "SpeculativeConfig",
    "StateSession",
    "StateStore",
    "generate_batch",
]
