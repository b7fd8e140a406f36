# The package first: its OMP_WAIT_POLICY=PASSIVE reaches OpenMP only if set before torch is loaded (with torch
# first, OpenMP busy-waits: a small matmul on 2 cores beside another process ran 10x slower); the suite runs as
# every verb does.
# isort: off
import astrai_pl  # noqa: F401
# isort: on
import os
import tempfile
from pathlib import Path

import pytest
import torch

from astrai_pl.checkpoint.runs import VERSION, point_latest

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Tokenized data is cached per test session, never in the user's home.
os.environ["ASTRAI_CACHE"] = tempfile.mkdtemp(prefix="astrai-test-cache-")
torch.set_num_threads(min(2, os.cpu_count() or 1))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)



def _restored_environment():
    """A test's Trainer may export MASTER_ADDR, LOCAL_RANK, PL_GLOBAL_SEED, …; they must not reach the
    processes that later tests launch (a child that sees LOCAL_RANK thinks its ranks are already launched)."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


# Module scope covers module-scoped fixtures (an autouse fixture is set up before the others of its scope).
_restore_environment_per_module = pytest.fixture(autouse=True, scope="module")(_restored_environment)
_restore_environment_per_test = pytest.fixture(autouse=True)(_restored_environment)



RUNS = Path(__file__).resolve().parents[1] / "runs"  # where the shipped configs' default_root_dir lie


def _pointer(path: Path) -> tuple[bool, str] | None:
    """A `latest` pointer as (is a symlink, what it names)."""
    if path.is_symlink():
        return True, os.readlink(path)
    return (False, path.read_text()) if path.is_file() else None


def _pointers() -> list[Path]:
    """Every runs/*/latest, a dangling symlink included (glob skips those)."""
    roots = RUNS.iterdir() if RUNS.is_dir() else ()
    return [root / "latest" for root in roots if (root / "latest").is_symlink() or (root / "latest").exists()]


@pytest.fixture(scope="session", autouse=True)
def _repository_runs_left_as_found():
    """Tests that instantiate a shipped config without a root of their own claim a run directory under the
    repository's runs/ and move its `latest`: afterwards the empty version_N folders they made go and each
    `latest` names again what it named, so `make test` after `make demo` leaves the demo's runs the newest. A run
    that trained beside the tests (`make demo` in another shell) keeps its folder, and `latest` names it."""
    roots = set(RUNS.iterdir()) if RUNS.is_dir() else set()
    runs = set(RUNS.glob("*/version_*"))
    pointers = {p: _pointer(p) for p in _pointers()}
    yield
    for run in set(RUNS.glob("*/version_*")) - runs:
        if run.is_dir() and not any(run.iterdir()):
            run.rmdir()
    beside = [run for run in set(RUNS.glob("*/version_*")) - runs if run.is_dir() and VERSION.fullmatch(run.name)]
    for pointer in set(_pointers()) | set(pointers):
        root, before = pointer.parent, pointers.get(pointer)
        newest = max((run for run in beside if run.parent == root), default=None,
                     key=lambda run: int(VERSION.fullmatch(run.name)[1]))
        present = pointer.is_symlink() or pointer.exists()
        if newest is not None:  # a run trained beside the tests (make demo in another shell) is the latest
            point_latest(root, newest)
        elif before is None:
            if present and not pointer.exists():  # it named an empty run removed above (dangling)
                pointer.unlink()
        elif root.is_dir() and (not present or _pointer(pointer) != before):
            if present:
                pointer.unlink()
            symlink, name = before
            if symlink:
                os.symlink(name, pointer, target_is_directory=True)
            else:
                pointer.write_text(name)
    for root in (set(RUNS.iterdir()) if RUNS.is_dir() else set()) - roots:
        if root.is_dir() and not any(root.iterdir()):
            root.rmdir()
