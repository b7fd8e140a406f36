"""Checkpoint files that are either complete or absent, and that fail loudly when damaged.

A `.ckpt` file is written atomically (astrai_pl/atomic.py) and read back through `read_checkpoint`, which
verifies the archive's CRC-32 checksums (torch.load itself does not) and unpickles with `weights_only=True`;
a truncated, corrupted or unsafe file raises CheckpointError naming the file, what is wrong with it and
which checkpoints remain. A sharded checkpoint folder is read through sharded.py.
"""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any

import torch

from .. import atomic
from ..model.hf import CheckpointError, nonfinite_tensors
from .sharded import CHECKSUMS, read_sharded_weights

ZIP_START = b"PK\x03\x04"  # local file header: the first thing a zip writer puts in the file
ZIP_END = b"PK\x05\x06"  # end-of-central-directory record: the last thing a zip writer puts in the file


# -- cut-off replaces ----------------------------------------------------------------------------------
def is_complete_copy(path: Path) -> bool:
    """A file is renamed into place only once written; a folder is complete once its checksum table is there."""
    return path.is_file() or (path / CHECKSUMS).is_file()


def interrupted_copy(target: Path) -> Path | None:
    """The complete checkpoint a cut-off `replace_path` left instead of a missing `target` (None when it exists)."""
    return atomic.interrupted_copy(target, is_complete_copy)


def recover_interrupted_replace(target: Path) -> None:
    """Finish what a cut-off `replace_path` of a checkpoint left (see astrai_pl/atomic.py)."""
    atomic.recover_interrupted_replace(target, is_complete_copy)


# -- reading ----------------------------------------------------------------------------------------------
def _siblings(path: Path) -> str:
    others = sorted(p.name for p in path.parent.glob("*.ckpt") if p.name != path.name)
    return ", ".join(others) if others else "none in the same folder"


def refused_by_weights_only(err: BaseException) -> bool:
    """True when `err` is torch.load(weights_only=True) refusing what a pickle names."""
    return "Weights only load failed" in str(err) or "Unsupported global" in str(err)


def describe_unreadable(path: Path | str, err: BaseException) -> str:
    """What to tell the user about a checkpoint that failed to load with `err`."""
    text = str(err).split("\n")[0][:300]
    if refused_by_weights_only(err):
        return (
            f"{path}: holds Python objects that loading with weights_only=True refuses ({text}). "
            "If you trust the file, load it with torch.load(path, weights_only=False) and save the plain "
            "state again, or allow the class with torch.serialization.add_safe_globals([...])."
        )
    return (
        f"{path}: not a readable checkpoint ({type(err).__name__}: {text}). Resume from another "
        f"checkpoint (remaining: {_siblings(Path(path))})."
    )


def verify_archive(path: Path) -> None:
    """Raise CheckpointError unless `path` is a complete zip archive whose members match their CRC-32."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(4)
        f.seek(max(0, size - 65_558))  # the end record sits within the last 64 KiB + 22 bytes
        tail = f.read()
    if size and head != ZIP_START:
        raise CheckpointError(
            f"{path}: not a checkpoint ({size} bytes that do not start like a torch.save archive: {head!r}). "
            "Fix: pass a .ckpt written by astrai-pl fit or torch.save, or a Hugging Face model directory."
        )
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
    names = ("meta.pt", ".metadata", "__0_0.distcp", "checksums.json")
    return path.is_dir() and any((path / name).exists() for name in names)


def check_sharded_complete(path: Path) -> None:
    """CheckpointError unless the folder has the two files every sharded checkpoint has."""
    if not (path / "meta.pt").is_file() or not (path / ".metadata").is_file():
        raise CheckpointError(
            f"{path}: incomplete sharded checkpoint (meta.pt or .metadata is missing). Resume "
            f"from another checkpoint (remaining: {_siblings(path)})."
        )


def _read_sharded(path: Path) -> dict[str, Any]:
    """The full weights and the metadata of a sharded checkpoint, read in this one process (no process
    group) through the checks of sharded.py: for init_from, convert and inspection. Its
    optimizer shards are left out."""
    check_sharded_complete(path)
    weights = read_sharded_weights(path)
    return {**read_checkpoint(path / "meta.pt"), "state_dict": weights}


def read_checkpoint(path: str | Path, map_location: Any = "cpu", weights_only: bool = True) -> dict[str, Any]:
    """torch.load after checking the archive (or the weights and metadata of a sharded checkpoint folder),
    with CheckpointError for every failure. A `path` that a cut-off replace left missing is read from the
    complete copy beside it."""
    path = Path(path)
    path = interrupted_copy(path) or path
    if is_sharded_checkpoint(path):
        return _read_sharded(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist; pass an existing .ckpt file or 'last'")
    verify_archive(path)
    try:
        return torch.load(path, map_location=map_location, weights_only=weights_only)
    except Exception as err:  # noqa: BLE001 - every failure becomes one typed error naming the file
        raise CheckpointError(describe_unreadable(path, err)) from err


def refuse_nonfinite_weights(checkpoint: dict[str, Any], path: Any) -> None:
    """CheckpointError, before anything is written, when a weight of `checkpoint` is NaN or ±inf."""
    bad = nonfinite_tensors(checkpoint.get("state_dict", {}).items())
    if bad:
        shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise CheckpointError(
            f"{path}: not written, because weights of step {checkpoint.get('global_step')} hold NaN or "
            f"infinite values ({shown}); the checkpoint already there is left as it was. Training diverged: "
            "lower the learning rate, keep gradient_clip_val set, and keep NonFiniteGuard on to stop at the cause."
        )


def checkpoint_error_in(err: BaseException) -> CheckpointError | None:
    """The CheckpointError among `err` and its causes (jsonargparse wraps the error of an objective that
    failed to build, such as a bad init_from, in a dump of the whole config)."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, CheckpointError):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def _interrupted_targets(folder: Path) -> set[Path]:
    """Checkpoints of `folder` that a replace cut off may have left beside themselves."""
    names = [p.name for p in folder.glob(".*.ckpt.old")] + [p.name for p in folder.glob(".*.ckpt.partial")]
    return {folder / name[1:].rsplit(".", 1)[0] for name in names}


def prepare_resume_from_last(trainer: Any, ckpt_path: Any) -> None:
    """Before `fit(ckpt_path="last")`: finish every cut-off replace in the ModelCheckpoint folders, then refuse
    to start from step 0 when they hold checkpoints but no last one. A run is new when its checkpoint
    folders hold no complete checkpoint (no `*.ckpt` file or folder): only then does "last" start afresh."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.utilities import rank_zero_only

    if ckpt_path != "last":
        return
    callbacks = [cb for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint) and cb.dirpath]
    folders = sorted({Path(cb.dirpath) for cb in callbacks if Path(cb.dirpath).is_dir()})
    for target in (t for folder in folders for t in _interrupted_targets(folder)):
        if rank_zero_only.rank == 0:
            recover_interrupted_replace(target)
        elif interrupted_copy(target) is not None:
            return  # rank 0 puts it back
    if any(cb._find_last_checkpoints(trainer) for cb in callbacks):
        return
    found = [folder / p.name for folder in folders for p in sorted(folder.iterdir())
             if p.name.endswith(".ckpt") and not p.name.startswith(".")]
    if found:
        raise CheckpointError(
            f"ckpt_path='last': {found[0].parent} holds no last checkpoint but holds "
            f"{', '.join(p.name for p in found[:5])}, so this run is not new and would restart from step 0. "
            f"Fix: resume from one of them (--ckpt_path {found[-1]}), or start afresh in another checkpoint folder."
        )


def read_remote_checkpoint(url: str, map_location: Any = "cpu") -> dict[str, Any]:
    """torch.load of a remote checkpoint (http(s)://, s3://, … through fsspec), always weights_only=True, with
    CheckpointError naming the address for every failure (Lightning's own reader unpickles http(s) addresses
    with weights_only=False)."""
    from lightning.fabric.utilities.cloud_io import get_filesystem

    try:
        with get_filesystem(url).open(url, "rb") as f:
            return torch.load(f, map_location=map_location, weights_only=True)
    except Exception as err:  # noqa: BLE001 - every failure becomes one typed error naming the address
        if refused_by_weights_only(err):
            raise CheckpointError(describe_unreadable(url, err)) from err
        text = str(err).split("\n")[0][:300]
        raise CheckpointError(f"{url}: not read as a checkpoint ({type(err).__name__}: {text}). Fix: check the "
                              "address, or download the file and pass its local path.") from err


def refusal_to_remove(path: Any) -> str | None:
    """Why `path` is not a checkpoint a run may delete, or None when it is one: a `.ckpt` file or a sharded
    checkpoint folder, reached without a '..' and not itself a symbolic link (a path recorded in a
    checkpoint file may point anywhere)."""
    text = str(path)
    if ".." in text.replace("\\", "/").split("/"):
        return "its path has a '..' component"
    if "://" in text:
        return None if text.rstrip("/").endswith(".ckpt") else "it does not end in .ckpt"
    entry = Path(path).absolute()
    if not atomic.exists(entry):
        return None  # nothing to remove
    if entry.is_symlink():
        return "it is a symbolic link"
    if entry.is_file() and entry.suffix == ".ckpt" or is_sharded_checkpoint(entry):
        return None
    return "it is neither a .ckpt file nor a sharded checkpoint folder"
