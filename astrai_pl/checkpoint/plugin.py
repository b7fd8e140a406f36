"""`AtomicCheckpointIO`, the Lightning CheckpointIO plugin over archive.py (`trainer.plugins:
[astrai_pl.checkpoint.AtomicCheckpointIO]`; `astrai-pl fit` adds it unless `safety.atomic_checkpoints` is false).

It writes to a hidden temporary file in the target folder, fsyncs it and renames it over the target, so a
crash mid-write leaves the previous checkpoint untouched, and reads back through `read_checkpoint`.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from .. import atomic
from .archive import read_checkpoint, read_remote_checkpoint, refusal_to_remove, refuse_nonfinite_weights


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning CheckpointIO: atomic local writes, verified `weights_only=True` reads, and no file written
    from weights that hold NaN or ±inf (CheckpointError; the previous file stays).

    Remote paths (s3://, gs://, …) go through Lightning's fsspec writer unchanged, and load weights-only.
    Removal deletes only checkpoints (`refusal_to_remove`): anything else is left, with a warning."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any = None) -> None:
        refuse_nonfinite_weights(checkpoint, path)
        if "://" in str(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        if storage_options is not None:
            raise TypeError(
                f"{type(self).__name__}.save_checkpoint: storage_options={storage_options!r} is "
                "not supported for local files; drop it"
            )
        atomic.write_atomically(Path(path), lambda f: torch.save(checkpoint, f))

    def load_checkpoint(
        self, path, map_location: Any = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Every path loads with weights_only=True, whatever the caller asks: a remote one (http(s)://, s3://,
        …) through `read_remote_checkpoint`, a local one through `read_checkpoint`; a failure is a
        CheckpointError naming it."""
        if "://" in str(path):
            return read_remote_checkpoint(str(path), map_location or "cpu")
        return read_checkpoint(path, map_location=map_location or "cpu")

    def remove_checkpoint(self, path) -> None:
        """Delete the checkpoint at `path`; a path that names anything else is left alone, with a warning (the
        run goes on: such a path comes from a stale or crafted record in a checkpoint file)."""
        refusal = refusal_to_remove(path)
        if refusal is not None:
            warnings.warn(f"{path}: not removed, because {refusal}; a run removes only its own checkpoints.",
                          stacklevel=2)
        elif "://" in str(path):
            super().remove_checkpoint(path)
        else:
            atomic.remove_path(Path(path))
