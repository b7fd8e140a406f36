"""Which files of a folder an export may replace: those a previous export wrote, listed with their size and
modification time in the folder's `.astrai-pl-export.json`, and unchanged since. Any other file that an export
would overwrite (the user's own config.json, weights from elsewhere) makes it refuse unless asked to overwrite;
a file it would not overwrite is carried into the new export as it is, whatever its name
(`model-finetuned-v3.safetensors` stays)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path

MANIFEST = ".astrai-pl-export.json"
_MAX_LISTED = 5


class ExportConflictError(FileExistsError):
    """The target folder holds files an export would overwrite that no export wrote."""


def _stamp(path: Path) -> list[int]:
    stat = path.stat()
    return [stat.st_size, stat.st_mtime_ns]


def write_manifest(folder: Path, names: Iterable[str]) -> None:
    """The manifest of the files `names` of `folder`, which this export wrote."""
    table = {name: _stamp(folder / name) for name in sorted(set(names)) if name != MANIFEST}
    (folder / MANIFEST).write_text(json.dumps({"files": table}, indent=1) + "\n")


def written_by_export(folder: Path) -> set[str]:
    """The names in `folder`'s manifest whose files are still as the export wrote them (none without one)."""
    try:
        table = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))["files"]
        items = list(table.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return set()
    ours = set()
    for name, stamp in items:
        path = folder / name if isinstance(name, str) and name not in ("", ".", "..") else None
        if path is not None and Path(name).name == name and path.is_file() and not path.is_symlink() \
                and _stamp(path) == stamp:
            ours.add(name)
    return ours


def check_overwrite(target: Path, writes: set[str], overwrite: bool, standard: Iterable[str] = (),
                    stale: Callable[[str], bool] = lambda name: False) -> set[str]:
    """The names of `target` the new export leaves out, given the names it `writes`: the `standard` ones it
    does not write (names a loader reads, e.g. a model.safetensors beside a new sharded index) and those `stale`
    says would contradict it (e.g. an older export's shards), when an export wrote them, or with `overwrite`
    for `standard` ones. Every other file is kept. ExportConflictError, before anything is written, when
    `target` holds a file named in `writes` or `standard` that no export wrote, unless `overwrite`."""
    if not target.is_dir():
        return set()
    ours, present = written_by_export(target), {entry.name for entry in target.iterdir()}
    standard = (present & set(standard)) - writes
    foreign = sorted(((present & writes) | standard) - ours)
    if foreign and not overwrite:
        listed = ", ".join(foreign[:_MAX_LISTED]) + (f" and {len(foreign) - _MAX_LISTED} more" if
                                                     len(foreign) > _MAX_LISTED else "")
        raise ExportConflictError(
            f"{target}: holds {listed}, which this export would overwrite and which no export wrote; nothing was "
            "written. Fix: pass overwrite=True (astrai-pl convert --overwrite) to replace them (other files of the "
            "folder are kept), or export into an empty or new folder.")
    outdated = {name for name in present - writes if stale(name)} | standard
    return {MANIFEST} | (outdated & ours) | (standard if overwrite else set())
