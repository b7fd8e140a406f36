"""Side concerns of a training run, as Lightning callbacks and loggers. `AtomicCheckpointIO`, `CheckpointError`
and `read_checkpoint` live in astrai_pl/checkpoint/ and are importable from here too."""

from ..checkpoint import AtomicCheckpointIO, CheckpointError, read_checkpoint
from .export import HFExport
from .metrics import JSONLLogger, NonFiniteGuard, NonFiniteLossError
from .resume import FinalCheckpoint, RNGState, StopOnSignal
from .samples import SampleGenerations
from .throughput import Throughput
from .tracking import ModelArtifact, WandbConfig

__all__ = [
    "AtomicCheckpointIO",
    "CheckpointError",
    "FinalCheckpoint",
    "HFExport",
    "JSONLLogger",
    "ModelArtifact",
    "NonFiniteGuard",
    "NonFiniteLossError",
    "RNGState",
    "SampleGenerations",
    "StopOnSignal",
    "Throughput",
    "WandbConfig",
    "read_checkpoint",
]
