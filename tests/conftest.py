import os
import tempfile

import pytest
import torch

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
