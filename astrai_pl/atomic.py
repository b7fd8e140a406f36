"""Writing or replacing a file or folder so that a kill at any moment leaves a complete copy, and finding it.

`write_atomically` writes a file under a temporary name beside its target, flushes it and renames it over
the target. For `replace_path`, a new copy is written as the hidden `.NAME.partial` beside its target; a
file replaces a file in one atomic rename. A folder cannot be renamed over a non-empty one, so the old
target is renamed aside (`.NAME.old`), the new one renamed in, and the old one deleted; a kill between the
two renames leaves both complete copies, which `interrupted_copy` finds and `recover_interrupted_replace`
puts back. What counts as a complete copy is the caller's `is_complete` (a sharded checkpoint: its checksum
table is written last; a Hugging Face export: its config.json is written last).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO


def fsync_dir(folder: Path) -> None:
    """Flush a folder's entries (renames, new files) to disk."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # some platforms cannot open a directory; the rename is still atomic
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_atomically(target: Path, write: Callable[[IO[bytes]], None], mode: int | None = None) -> None:
    """Run `write(file)` on a temporary file beside `target`, flush it to disk, then rename it over `target`
    with permissions `mode` (default: those of a new file under the umask)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    for stale in target.parent.glob(f".{target.name}.*.partial"):  # left by a writer that was killed
        stale.unlink(missing_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask() if mode is None else mode)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(target.parent)


def partial_path(target: Path) -> Path:
    """Where a new copy of `target` is written before it is moved to `target`."""
    return target.with_name(f".{target.name}.partial")


def aside_path(target: Path) -> Path:
    """Where `replace_path` keeps the previous `target` while the new one is moved in."""
    return target.with_name(f".{target.name}.old")


def exists(path: Path) -> bool:
    """True for anything at `path`, a dangling symbolic link included."""
    return path.exists() or path.is_symlink()


def remove_path(path: Path) -> None:
    """Delete a file, a link (never what it points to) or a folder with its contents; nothing there is fine."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif exists(path):
        path.unlink()


def replace_path(new: Path, target: Path) -> None:
    """Move `new` (a complete file or folder) to `target`, replacing whatever is there (see the module doc)."""
    aside = aside_path(target)
    if exists(target) and (new.is_dir() or target.is_dir()):
        remove_path(aside)  # left by a replace cut off after its second rename
        os.replace(target, aside)
        fsync_dir(target.parent)
    os.replace(new, target)
    fsync_dir(target.parent)
    remove_path(aside)
    fsync_dir(target.parent)


def interrupted_copy(target: Path, is_complete: Callable[[Path], bool]) -> Path | None:
    """The complete copy a `replace_path` cut off between its two renames left instead of a missing `target`:
    the new copy when `is_complete` says so, else the previous one. None when `target` exists."""
    if exists(target):
        return None
    for candidate in (partial_path(target), aside_path(target)):
        if exists(candidate) and (candidate == aside_path(target) or is_complete(candidate)):
            return candidate
    return None


def recover_interrupted_replace(target: Path, is_complete: Callable[[Path], bool]) -> None:
    """Finish what a cut-off `replace_path` left: move the complete copy to `target`, drop the previous one."""
    copy = interrupted_copy(target, is_complete)
    if copy is not None:
        os.replace(copy, target)
        fsync_dir(target.parent)
    if exists(target) and exists(aside_path(target)):
        remove_path(aside_path(target))
