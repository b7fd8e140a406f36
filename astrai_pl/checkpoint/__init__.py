"""Persistence below everything that trains or serves: checkpoint files that are complete or absent and
fail loudly when damaged, sharded checkpoint folders read without running code, and loading a Transformer
from a checkpoint or a Hugging Face directory. No code ever executes from a file.

    archive.py   `.ckpt` files: verified weights-only reads, remote reads, recovery of a cut-off replace
    sharded.py   torch.distributed.checkpoint folders (FSDP2Strategy): restricted metadata, checksums
    loading.py   `load_transformer(arch, init_from)` and the checks of weights against their model
    plugin.py    `AtomicCheckpointIO`, the Lightning CheckpointIO plugin over archive.py

Atomic writes themselves are astrai_pl/atomic.py.
"""

from ..model.hf import CheckpointError
from .archive import is_sharded_checkpoint, read_checkpoint
from .loading import as_config, load_transformer


def __getattr__(name: str):
    """`AtomicCheckpointIO` on first use: it imports Lightning, which reading checkpoints (generate, serve) never needs."""
    if name == "AtomicCheckpointIO":
        from .plugin import AtomicCheckpointIO

        return AtomicCheckpointIO
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = ["AtomicCheckpointIO", "CheckpointError", "as_config", "is_sharded_checkpoint", "load_transformer",
           "read_checkpoint"]
