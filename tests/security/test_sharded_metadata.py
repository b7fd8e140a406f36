"""A sharded checkpoint's `.metadata` can build only the metadata dataclasses it admits: pickle's BUILD on any
other object (a class above all, where BUILD becomes setattr on the class) is refused before it runs."""

from __future__ import annotations

import pickle
import zlib
from pathlib import Path, PosixPath

import pytest
import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex

from astrai_pl.checkpoint.sharded import read_dcp_metadata, read_sharded_weights
from astrai_pl.model.hf import CheckpointError


def _build_on_the_class(attribute: str, value: str) -> bytes:
    """GLOBAL pathlib.PosixPath, then BUILD with slot state {attribute: value}: setattr on the class itself."""
    state = pickle.dumps((None, {attribute: value}), protocol=2)[2:-1]  # without PROTO and STOP
    return b"\x80\x02cpathlib\nPosixPath\n" + state + pickle.BUILD + pickle.STOP


def test_build_on_an_admitted_class_is_refused_and_leaves_it_unchanged(tmp_path):
    (tmp_path / ".metadata").write_bytes(_build_on_the_class("name", "__0_0.distcp"))
    try:
        with pytest.raises(CheckpointError) as info:
            read_dcp_metadata(tmp_path)
        assert Path("../other/__1_0.distcp").name == "__1_0.distcp"  # the check for shards outside the folder
        assert "BUILD on a type" in str(info.value) and "nothing in it was run" in str(info.value)
    finally:
        if "name" in PosixPath.__dict__:  # a reader that ran the BUILD set it: put pathlib back for the others
            del PosixPath.name


class _Rebuilt:
    """Pickles as Metadata({}) followed by BUILD with slot state `state`."""

    def __init__(self, state: dict):
        self.state = state

    def __reduce__(self):
        return (Metadata, ({},), (None, self.state))


@pytest.mark.parametrize("state", [{"__class__": MetadataIndex}, {"not_a_field": 1}])
def test_build_with_anything_but_the_dataclass_fields_is_refused(tmp_path, state):
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Rebuilt(state), protocol=2))
    with pytest.raises(CheckpointError, match=rf"BUILD .*{next(iter(state))}"):
        read_dcp_metadata(tmp_path)


def test_real_metadata_still_reads(tmp_path):
    from torch.distributed.checkpoint import save

    save({"state_dict": {"w": torch.arange(6.0).reshape(2, 3)}}, checkpoint_id=tmp_path, no_dist=True)
    md = read_dcp_metadata(tmp_path)
    assert isinstance(md, Metadata)
    assert all(isinstance(c, ChunkStorageMetadata) for c in md.state_dict_metadata["state_dict.w"].chunks)


def test_a_folder_without_checksums_is_refused(tmp_path):
    from torch.distributed.checkpoint import save

    save({"state_dict": {"w": torch.arange(6.0)}}, checkpoint_id=tmp_path, no_dist=True)
    with pytest.raises(CheckpointError, match=rf"{tmp_path}: no checksums\.json"):
        read_sharded_weights(tmp_path)
    files = {p.name: [p.stat().st_size, zlib.crc32(p.read_bytes())] for p in tmp_path.iterdir() if p.is_file()}
    (tmp_path / "checksums.json").write_text(__import__("json").dumps({"algorithm": "crc32", "files": files}))
    assert torch.equal(read_sharded_weights(tmp_path)["w"], torch.arange(6.0))
