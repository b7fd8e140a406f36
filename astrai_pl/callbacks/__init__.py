"""Side concerns of a training run, as Lightning callbacks, a logger and a checkpoint plugin."""

from .checkpoint import AtomicCheckpointIO, CheckpointError, read_checkpoint
from .export import HFExport
from .metrics import JSONLLogger, NonFiniteGuard, NonFiniteLossError
from .resume import RNGState, StopOnSignal
from .throughput import Throughput

__all__ = [
    "AtomicCheckpointIO",
    "CheckpointError",
    "HFExport",
    "JSONLLogger",
    "NonFiniteGuard",
    "NonFiniteLossError",
    "RNGState",
    "StopOnSignal",
    "Throughput",
    "read_checkpoint",
]
