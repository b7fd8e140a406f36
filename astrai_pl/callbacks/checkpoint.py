"""Checkpoint files that are either complete or absent, and that fail loudly when damaged.

`AtomicCheckpointIO` (a Lightning CheckpointIO plugin, `trainer.plugins: [astrai_pl.callbacks.AtomicCheckpointIO]`)
writes to a hidden temporary file in the target folder, fsyncs it and renames it over the target, so a
crash mid-write leaves the previous checkpoint untouched. Loading verifies the archive's CRC-32 checksums
(torch.load itself does not) and unpickles with `weights_only=True`; a truncated, corrupted or unsafe file
raises CheckpointError naming the file, what is wrong with it and which checkpoints remain.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from ..model.hf import CheckpointError

ZIP_END = b"PK\x05\x06"  # end-of-central-directory record: the last thing a zip writer puts in the file


# -- writing ----------------------------------------------------------------------------------------------
def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # some platforms cannot open a directory; the rename is still atomic
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(target: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Run `write(file)` on a temporary file beside `target`, flush it to disk, then rename it over `target`."""
    target.parent.mkdir(parents=True, exist_ok=True)
    for stale in target.parent.glob(f".{target.name}.*.partial"):  # left by a writer that was killed
        stale.unlink(missing_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(target.parent)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def replace_path(new: Path, target: Path) -> None:
    """Move `new` (a file or a directory) to `target`, replacing whatever is there.

    A file replaces a file in one atomic rename. A directory cannot be renamed over a non-empty one, so
    the old target is first renamed aside and deleted after the new one is in place."""
    if not target.exists() and not target.is_symlink():
        os.replace(new, target)
    elif new.is_file() and (target.is_file() or target.is_symlink()):
        os.replace(new, target)
    else:
        aside = target.with_name(f".{target.name}.old")
        if aside.exists():
            shutil.rmtree(aside) if aside.is_dir() else aside.unlink()
        os.replace(target, aside)
        os.replace(new, target)
        shutil.rmtree(aside) if aside.is_dir() else aside.unlink()
    _fsync_dir(target.parent)


# -- reading ----------------------------------------------------------------------------------------------
def _siblings(path: Path) -> str:
    others = sorted(p.name for p in path.parent.glob("*.ckpt") if p.name != path.name)
    return ", ".join(others) if others else "none in the same folder"


def describe_unreadable(path: Path, err: BaseException) -> str:
    """What to tell the user about a checkpoint that failed to load with `err`."""
    text = str(err).split("\n")[0][:300]
    if "Weights only load failed" in str(err) or "Unsupported global" in str(err):
        return (
            f"{path}: holds Python objects that loading with weights_only=True refuses ({text}). "
            "If you trust the file, load it with torch.load(path, weights_only=False) and save the plain "
            "state again, or allow the class with torch.serialization.add_safe_globals([...])."
        )
    return (
        f"{path}: not a readable checkpoint ({type(err).__name__}: {text}). Resume from another "
        f"checkpoint (remaining: {_siblings(path)})."
    )


def verify_archive(path: Path) -> None:
    """Raise CheckpointError unless `path` is a complete zip archive whose members match their CRC-32."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        f.seek(max(0, size - 65_558))  # the end record sits within the last 64 KiB + 22 bytes
        tail = f.read()
    if ZIP_END not in tail:
        raise CheckpointError(
            f"{path}: truncated checkpoint ({size} bytes; the end of the archive is missing), so its write was "
            f"cut off. Resume from an earlier checkpoint (remaining: {_siblings(path)})."
        )
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, ValueError, UnicodeDecodeError, EOFError) as err:
        raise CheckpointError(
            f"{path}: corrupted checkpoint (its archive index is unreadable: {err}). Resume "
            f"from an earlier checkpoint (remaining: {_siblings(path)})."
        ) from err
    if bad is not None:
        raise CheckpointError(
            f"{path}: corrupted checkpoint: the bytes of {bad!r} do not match the checksum written with them "
            f"(a disk or copy error). Resume from an earlier checkpoint (remaining: {_siblings(path)})."
        )


def is_sharded_checkpoint(path: Path) -> bool:
    """A folder written by FSDP2Strategy with save_distributed_checkpoint=True (or one that tries to be)."""
    return path.is_dir() and any((path / name).exists() for name in ("meta.pt", ".metadata", "__0_0.distcp"))


def _read_sharded(path: Path) -> dict[str, Any]:
    """The full weights and the metadata of a sharded checkpoint, read in this one process (no process
    group): for init_from, convert and inspection. Its optimizer shards are left out."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    if not (path / "meta.pt").is_file() or not (path / ".metadata").is_file():
        raise CheckpointError(
            f"{path}: incomplete sharded checkpoint (meta.pt or .metadata is missing). Resume "
            f"from another checkpoint (remaining: {_siblings(path)})."
        )
    metadata = read_checkpoint(path / "meta.pt")
    with tempfile.TemporaryDirectory() as scratch:
        try:
            dcp_to_torch_save(path, Path(scratch) / "full.pt")
        except Exception as err:  # noqa: BLE001 - a shard that cannot be read becomes one typed error
            raise CheckpointError(describe_unreadable(path, err)) from err
        full = torch.load(Path(scratch) / "full.pt", map_location="cpu", weights_only=True)
    return {**metadata, "state_dict": full["state_dict"]}


def read_checkpoint(path: str | Path, map_location: Any = "cpu", weights_only: bool = True) -> dict[str, Any]:
    """torch.load after checking the archive (or the weights and metadata of a sharded checkpoint folder),
    with CheckpointError for every failure."""
    path = Path(path)
    if is_sharded_checkpoint(path):
        return _read_sharded(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist; pass an existing .ckpt file or 'last'")
    verify_archive(path)
    try:
        return torch.load(path, map_location=map_location, weights_only=weights_only)
    except Exception as err:  # noqa: BLE001 - every failure becomes one typed error naming the file
        raise CheckpointError(describe_unreadable(path, err)) from err


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning CheckpointIO: atomic local writes, verified `weights_only=True` reads.

    Remote paths (s3://, gs://, …) go through Lightning's fsspec writer unchanged."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any = None) -> None:
        if "://" in str(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        if storage_options is not None:
            raise TypeError(
                f"{type(self).__name__}.save_checkpoint: storage_options={storage_options!r} is "
                "not supported for local files; drop it"
            )
        write_atomically(Path(path), lambda f: torch.save(checkpoint, f))

    def load_checkpoint(
        self, path, map_location: Any = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        if "://" in str(path):
            return super().load_checkpoint(path, map_location, weights_only)
        return read_checkpoint(
            path, map_location=map_location or "cpu", weights_only=weights_only is not False
        )
