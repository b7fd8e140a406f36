"""Exact resume of a streamed, mixed corpus: a run killed by SIGKILL and resumed with `--ckpt_path last`
logs the same loss at every later step and ends with the same weights, bit for bit, as the run that was
never interrupted; the checkpoint holds the stream's position after the last trained batch."""

from __future__ import annotations

import json
import os
import random
import signal

import pytest
import torch
import yaml
from fit_runs import WORDS, debug_config, final_weights, finish, launch, losses, wait_for_lines

from astrai_pl.callbacks import read_checkpoint

MAX_STEPS, ACCUMULATE = 8, 2

pytestmark = pytest.mark.slow


def _write_jsonl(path, docs: int, seed: int):
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(docs):
            f.write(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 30)))}) + "\n")
    return path


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    folder = tmp_path_factory.mktemp("shards")
    for k in range(3):
        _write_jsonl(folder / f"web-{k}.jsonl", 40, k)
    (folder / "code.txt").write_text("\n".join(f"def f{i}(x): return x + {i}" for i in range(200)))
    return folder


def _config(folder, shards):
    path = debug_config(folder, shards / "code.txt", max_steps=MAX_STEPS, accumulate=ACCUMULATE,
                        every_n_train_steps=2, batch_size=4)
    cfg = yaml.safe_load(path.read_text())
    cfg["data"]["init_args"].update(
        path=None, streaming=True, val_rows=8, shuffle_rows=16, cache_dir=str(folder / "cache"),
        sources=[{"path": str(shards / "web-*.jsonl"), "weight": 2.0}, {"path": str(shards / "code.txt")}])
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def reference(tmp_path_factory, shards):
    config = _config(tmp_path_factory.mktemp("reference"), shards)
    return launch(config), config.parent


def test_sigkill_mid_mixture_then_resume_is_bit_identical(tmp_path, shards, reference):
    config = _config(tmp_path, shards)
    proc = launch(config)
    wait_for_lines(tmp_path / "metrics.jsonl", random.Random().randint(3, 5), proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    ckpt = read_checkpoint(tmp_path / "ckpt" / "last.ckpt")
    (loader,) = ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    step = ckpt["global_step"]
    assert 0 < step < MAX_STEPS
    assert loader["batches"] == step * ACCUMULATE  # the trained batches, not those fetched ahead
    assert all(t > 0 for t in loader["tokens"])  # both sources were read: the kill fell mid-mixture

    finish(launch(config, "--ckpt_path", "last"))
    ref_proc, ref_folder = reference
    finish(ref_proc)
    expected, got = losses(ref_folder), losses(tmp_path)
    later = [s for s in expected if s >= step]
    assert later and [got[s] for s in later] == [expected[s] for s in later]
    ref_weights, weights = final_weights(ref_folder), final_weights(tmp_path)
    assert all(torch.equal(ref_weights[k], weights[k]) for k in ref_weights)
    shares = losses(ref_folder, "data/share/code")
    assert shares and all(0 < v < 1 for v in shares.values())  # the realised mixture is logged
