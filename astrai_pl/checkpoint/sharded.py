"""Sharded checkpoint folders (torch.distributed.checkpoint, written by FSDP2Strategy), read without running code.

torch's own reader unpickles `.metadata` with plain pickle and loads every non-tensor entry of the shards
with `torch.load(weights_only=False)`; either runs whatever a crafted folder holds. Here `.metadata` goes
through an unpickler that admits only the metadata dataclasses of torch.distributed.checkpoint and the
torch and pathlib types inside them, its fields are checked (shard files must be plain names inside the
folder), and non-tensor entries load with `weights_only=True`. Every read goes through `VerifiedReader`.

At save, `checksums.json` (size and CRC-32 of every file) is written last, so its presence also marks a
folder as complete. It is verified before anything is read; a folder without one is refused.
"""

from __future__ import annotations

import dataclasses
import io
import json
import pickle
import zlib
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ..atomic import write_atomically
from ..model.hf import CheckpointError

CHECKSUMS = "checksums.json"
DCP_METADATA = ".metadata"
_DCP = "torch.distributed.checkpoint.metadata"
_PICKLED_NAMES = {
    (_DCP, "Metadata"), (_DCP, "TensorStorageMetadata"), (_DCP, "TensorProperties"),
    (_DCP, "ChunkStorageMetadata"), (_DCP, "BytesStorageMetadata"), (_DCP, "MetadataIndex"),
    (_DCP, "StorageMeta"), (_DCP, "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib._local", "PosixPath"),
    ("collections", "OrderedDict"),
}
_CHUNK = 8 << 20


_BUILDABLE = {cls: frozenset(f.name for f in dataclasses.fields(cls)) for cls in (
    Metadata, TensorStorageMetadata, TensorProperties, ChunkStorageMetadata, BytesStorageMetadata, MetadataIndex,
    StorageMeta, _StorageInfo)}


class _MetadataUnpickler(pickle._Unpickler):  # the Python unpickler: its BUILD can be checked before it runs
    """Admits the names a `.metadata` file of torch.distributed.checkpoint holds, and torch dtypes; BUILD only
    on instances of the metadata dataclasses, with their own fields (on a class, BUILD would set its
    attributes for the whole process, e.g. `PosixPath.name`)."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _PICKLED_NAMES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} has no place in checkpoint metadata")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent ids have no place in checkpoint metadata")

    def load_build(self) -> None:
        state, inst = self.stack[-1], self.stack[-2]
        fields = _BUILDABLE.get(type(inst))
        if fields is None:
            raise pickle.UnpicklingError(f"BUILD on a {type(inst).__name__} has no place in checkpoint metadata")
        if type(inst) is not TensorProperties:  # its own __setstate__ unpacks a 5-tuple into its fields
            parts = state if isinstance(state, tuple) and len(state) == 2 else (state, None)
            for part in (p for p in parts if p is not None):
                unknown = [k for k in part if k not in fields] if isinstance(part, dict) else [part]
                if unknown:
                    raise pickle.UnpicklingError(f"BUILD of {type(inst).__name__} sets {unknown[0]!r}, not one of "
                                                 "its fields")
        super().load_build()

    dispatch[pickle.BUILD[0]] = load_build


def _entry_problem(key: Any, entry: Any) -> str | None:
    if not isinstance(key, str) or not isinstance(entry, (TensorStorageMetadata, BytesStorageMetadata)):
        return f"entry {key!r} is a {type(entry).__name__}"
    if isinstance(entry, TensorStorageMetadata) and not (
        isinstance(entry.size, torch.Size) and isinstance(entry.chunks, list) and all(
            isinstance(c, ChunkStorageMetadata) and len(c.offsets) == len(c.sizes) == len(entry.size)
            for c in entry.chunks)
    ):
        return f"tensor {key!r} has a malformed shape or chunk list"
    return None


def _storage_problem(index: Any, info: Any) -> str | None:
    name = getattr(info, "relative_path", None)
    inside = isinstance(name, str) and Path(name).name == name and name not in ("", ".", "..")
    spans = all(isinstance(getattr(info, f, None), int) and getattr(info, f) >= 0 for f in ("offset", "length"))
    if not isinstance(index, MetadataIndex) or not inside or not spans:
        return f"the storage entry of {getattr(index, 'fqn', index)!r} points at {name!r}, outside its folder"
    return None


def _check_metadata(md: Any) -> str | None:
    """Why `md` is not the metadata of a sharded checkpoint whose shards lie inside its folder, or None."""
    if type(md) is not Metadata or not isinstance(md.state_dict_metadata, dict):
        return f"it holds a {type(md).__name__}, not torch.distributed.checkpoint Metadata"
    if not isinstance(md.storage_data, dict) or not isinstance(md.planner_data, (dict, type(None))):
        return "its storage or planner tables are not mappings"
    for key, path in (md.planner_data or {}).items():
        if not isinstance(path, (tuple, list)) or not all(isinstance(p, (str, int)) for p in path):
            return f"the planner entry of {key!r} is not a key path"
    if md.planner_data is not None and set(md.state_dict_metadata) - set(md.planner_data):
        return "some entries have no planner entry"
    problems = [_entry_problem(k, e) for k, e in md.state_dict_metadata.items()]
    problems += [_storage_problem(i, info) for i, info in md.storage_data.items()]
    return next((p for p in problems if p), None)


def read_dcp_metadata(folder: Path) -> Metadata:
    """`.metadata` of a sharded checkpoint folder through the restricted unpickler, checked field by field."""
    file = folder / DCP_METADATA
    try:
        with open(file, "rb") as f:
            md = _MetadataUnpickler(f).load()
    except Exception as err:  # noqa: BLE001 - whatever the bytes are, the answer is one typed error
        raise CheckpointError(
            f"{folder}: {DCP_METADATA} is not checkpoint metadata ({type(err).__name__}: {err}); nothing "
            "in it was run. Fix: use a checkpoint folder written by astrai-pl fit, or one from a source you trust."
        ) from None
    problem = _check_metadata(md)
    if problem:
        raise CheckpointError(f"{folder}: {DCP_METADATA} is not the metadata of a sharded checkpoint: {problem}. "
                              "Fix: use a checkpoint folder written by astrai-pl fit.")
    return md


# -- checksums --------------------------------------------------------------------------------------------
def file_checksums(folder: Path, names: list[str]) -> dict[str, list[int]]:
    """{name: [size in bytes, CRC-32]} of the files `names` in `folder`."""
    sums = {}
    for name in names:
        crc = 0
        with open(folder / name, "rb") as f:
            while block := f.read(_CHUNK):
                crc = zlib.crc32(block, crc)
        sums[name] = [(folder / name).stat().st_size, crc]
    return sums


def write_checksums(folder: Path, sums: dict[str, list[int]]) -> None:
    """The checksum table of `folder`, written atomically: the last file of a complete sharded checkpoint."""
    text = json.dumps({"algorithm": "crc32", "files": dict(sorted(sums.items()))}, indent=1)
    write_atomically(folder / CHECKSUMS, lambda f: f.write(text.encode("utf-8")))


def read_checksums(folder: Path) -> dict[str, list[int]]:
    """The checksum table of `folder`; CheckpointError when it has none (a folder written without it is
    incomplete, or not one this project wrote, and its shards cannot be verified)."""
    file = folder / CHECKSUMS
    if not file.is_file():
        raise CheckpointError(f"{folder}: no {CHECKSUMS}, so its shards cannot be verified (every sharded "
                              "checkpoint astrai-pl fit writes ends with one; a folder without it is incomplete, "
                              "or was not written here). Fix: resume from another checkpoint, or load the folder "
                              "with torch.distributed.checkpoint yourself if you trust its source.")
    try:
        table = json.loads(file.read_text(encoding="utf-8"))["files"]
        if not all(isinstance(n, str) and Path(n).name == n and isinstance(v, list) and len(v) == 2
                   and all(isinstance(x, int) for x in v) for n, v in table.items()):
            raise ValueError("an entry is not [size, crc32]")
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as err:
        raise CheckpointError(f"{file}: unreadable checksum table ({type(err).__name__}: {err}). Fix: resume "
                              "from another checkpoint, or copy the folder again from where it was written.") from None
    return table


def checksum_mismatch(folder: Path, expected: dict[str, list[int]], names: list[str]) -> str | None:
    """What in `folder` differs from its checksum table, among `names` (None: nothing)."""
    for name in names:
        if not (folder / name).is_file():
            return f"{folder}: {name} is missing (it was written with the checkpoint)"
        if file_checksums(folder, [name])[name] != expected[name]:
            return (f"{folder}: corrupted checkpoint: the bytes of {name} do not match the checksum written "
                    "with them (a disk or copy error)")
    return None


def verify_folder(folder: Path, md: Metadata, expected: dict[str, list[int]]) -> None:
    """Every shard the metadata names is in the checksum table."""
    unlisted = sorted({info.relative_path for info in md.storage_data.values()} - set(expected))
    if unlisted or DCP_METADATA not in expected:
        raise CheckpointError(f"{folder}: {', '.join(unlisted) or DCP_METADATA} is not in its {CHECKSUMS}, so "
                              "the folder is not the one that was written. Fix: resume from another checkpoint.")


# -- reading ----------------------------------------------------------------------------------------------
class _WeightsOnlyBytes:
    """A load planner whose non-tensor entries are unpickled with weights_only=True first."""

    def __init__(self, planner: Any):
        self._planner = planner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        plain = io.BytesIO()
        torch.save(torch.load(value, map_location="cpu", weights_only=True), plain)
        plain.seek(0)
        self._planner.load_bytes(read_item, plain)


class VerifiedReader(FileSystemReader):
    """FileSystemReader over metadata read by `read_dcp_metadata`; non-tensor entries load weights-only."""

    def __init__(self, folder: Path, metadata: Metadata):
        super().__init__(folder)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata.storage_meta is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata

    def read_data(self, plan: Any, planner: Any) -> Any:
        return super().read_data(plan, _WeightsOnlyBytes(planner))


def describe_dcp_failure(folder: Path, err: BaseException) -> str:
    """One line for an error of torch.distributed.checkpoint (a CheckpointException carries one per rank)."""
    if isinstance(err, CheckpointException) and err.failures:
        err = next(iter(err.failures.values()))[0]
    text = str(err).strip().split("\n")[0][:300] or "a shard ends before the data its metadata points at"
    return (f"{folder}: the sharded checkpoint cannot be read ({type(err).__name__}: {text}). Fix: resume "
            "from another checkpoint, or load it into the model that wrote it.")


def load_into(state: dict[str, Any], folder: Path, md: Metadata, **kwargs: Any) -> None:
    """torch.distributed.checkpoint.load of `state` from `folder` through VerifiedReader; CheckpointError on failure."""
    from torch.distributed.checkpoint import load

    try:
        load(state, storage_reader=VerifiedReader(folder, md), **kwargs)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as err:  # CheckpointException derives from BaseException
        raise CheckpointError(describe_dcp_failure(folder, err)) from err


def read_sharded_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The `state_dict` entries of a sharded checkpoint, gathered in this one process (no process group)."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    expected = read_checksums(folder)
    problem = checksum_mismatch(folder, expected, sorted(expected))
    if problem:
        raise CheckpointError(f"{problem}. Fix: resume from another checkpoint.")
    md = read_dcp_metadata(folder)
    verify_folder(folder, md, expected)
    state: dict[str, Any] = {}
    try:
        _load_state_dict(state, VerifiedReader(folder, md), no_dist=True,
                         planner=_EmptyStateDictLoadPlanner(keys={"state_dict"}))
    except (Exception, CheckpointException) as err:  # CheckpointException derives from BaseException
        raise CheckpointError(describe_dcp_failure(folder, err)) from err
    weights = state.get("state_dict")
    if not isinstance(weights, dict) or not all(isinstance(v, torch.Tensor) for v in weights.values()):
        raise CheckpointError(f"{folder}: holds no model weights under 'state_dict'. "
                              "Fix: use a checkpoint folder written by astrai-pl fit.")
    return weights
