"""Exact resume of a streamed, mixed corpus and of streamed SFT rows: a run killed by SIGKILL and resumed with
`--ckpt_path last` logs the same loss at every later step and ends with the same weights, bit for bit, as the
run that was never interrupted; the checkpoint holds the stream's position after the last trained batch."""

from __future__ import annotations

import json
import os
import random
import signal

import pytest
import torch
import yaml
from fit_runs import WORDS, debug_config, final_weights, finish, losses, wait_for_lines
from forked_fit import launch_forked as launch

from astrai_pl.callbacks import read_checkpoint

MAX_STEPS, ACCUMULATE = 8, 2


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


def _kill_mid_run(config, folder):
    """Launch `config`, SIGKILL it after a few logged steps: the checkpoint's loader state and step."""
    proc = launch(config)
    wait_for_lines(folder / "metrics.jsonl", random.Random().randint(3, 5), proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    ckpt = read_checkpoint(folder / "ckpt" / "last.ckpt")
    (loader,) = ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert 0 < ckpt["global_step"] < MAX_STEPS
    return loader, ckpt["global_step"]


def _assert_resumed_like(reference, folder, step):
    """The resumed run logged the reference's losses from `step` on and ends with its weights, bit for bit."""
    expected, got = losses(reference), losses(folder)
    later = [s for s in expected if s >= step]
    assert later and [got[s] for s in later] == [expected[s] for s in later]
    ref_weights, weights = final_weights(reference), final_weights(folder)
    assert all(torch.equal(ref_weights[k], weights[k]) for k in ref_weights)


def test_sigkill_mid_mixture_then_resume_is_bit_identical(tmp_path, shards, reference):
    config = _config(tmp_path, shards)
    loader, step = _kill_mid_run(config, tmp_path)
    assert loader["batches"] == step * ACCUMULATE  # the trained batches, not those fetched ahead
    assert all(t > 0 for t in loader["tokens"])  # both sources were read: the kill fell mid-mixture

    finish(launch(config, "--ckpt_path", "last"))
    ref_proc, ref_folder = reference
    finish(ref_proc)
    _assert_resumed_like(ref_folder, tmp_path, step)
    shares = losses(ref_folder, "data/share/code")
    assert shares and all(0 < v < 1 for v in shares.values())  # the realised mixture is logged


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    folder = tmp_path_factory.mktemp("chats")
    rng = random.Random(0)
    for k in range(2):
        with open(folder / f"chat-{k}.jsonl", "w") as f:
            for _ in range(40):
                a, b = rng.randint(0, 99), rng.randint(0, 99)
                f.write(json.dumps({"messages": [{"role": "user", "content": f"What is {a} + {b}?"},
                                                 {"role": "assistant", "content": str(a + b)}]}) + "\n")
    return folder


def _sft_config(folder, chats):
    path = debug_config(folder, chats / "chat-0.jsonl", max_steps=MAX_STEPS, accumulate=ACCUMULATE,
                        every_n_train_steps=2, batch_size=4)
    cfg = yaml.safe_load(path.read_text())
    cfg["model"]["class_path"] = "astrai_pl.objectives.SFT"
    cfg["data"] = {"class_path": "astrai_pl.data.SFTData", "init_args": {
        "path": str(chats / "chat-*.jsonl"), "tokenizer": "byte", "streaming": True, "max_seq_len": 64,
        "batch_size": 2, "val_rows": 4, "shuffle_rows": 8, "cache_dir": str(folder / "cache")}}
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def test_sft_stream_sigkill_then_resume_is_bit_identical(tmp_path, tmp_path_factory, chats):
    """Packed SFT examples streamed with accumulation windows: the resumed run's losses and weights are the
    uninterrupted run's, and the checkpoint counts only the trained batches."""
    reference = tmp_path_factory.mktemp("sft-reference")
    ref_proc = launch(_sft_config(reference, chats))
    config = _sft_config(tmp_path, chats)
    loader, step = _kill_mid_run(config, tmp_path)
    assert loader["inner"]["batches"] == step * ACCUMULATE  # the trained batches: nothing fetched ahead
    finish(launch(config, "--ckpt_path", "last"))
    finish(ref_proc)
    _assert_resumed_like(reference, tmp_path, step)
