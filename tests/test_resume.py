"""Exact resume: a run killed at a random step (SIGKILL) or stopped with SIGTERM, then resumed with
`--ckpt_path last`, logs the same loss at every later step and ends with the same weights, bit for bit, as
the run that was never interrupted. Pretrain with gradient accumulation over an epoch boundary."""

from __future__ import annotations

import os
import random
import signal

import pytest
import torch
from fit_runs import debug_config, final_weights, finish, losses, wait_for_lines, write_corpus
from forked_fit import launch_forked as launch

from astrai_pl.callbacks import read_checkpoint

MAX_STEPS, ACCUMULATE, BATCHES_PER_EPOCH = 10, 2, 14  # 7 optimizer steps per epoch: the runs cross one


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus") / "corpus.txt")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus):
    """The uninterrupted run, started at once and awaited by the tests that compare against it."""
    config = debug_config(
        tmp_path_factory.mktemp("reference"),
        corpus,
        max_steps=MAX_STEPS,
        accumulate=ACCUMULATE,
        every_n_train_steps=3,
    )
    return launch(config), config.parent


def _config(tmp_path, corpus):
    return debug_config(tmp_path, corpus, max_steps=MAX_STEPS, accumulate=ACCUMULATE, every_n_train_steps=3)


def _assert_continues_exactly(reference, resumed_folder, resumed_from: int) -> None:
    proc, ref_folder = reference
    finish(proc)
    expected, got = losses(ref_folder), losses(resumed_folder)
    later = [step for step in expected if step >= resumed_from]
    assert later and all(step in got for step in later)
    assert [got[s] for s in later] == [expected[s] for s in later]  # bit-identical, every later step
    ref_weights, weights = final_weights(ref_folder), final_weights(resumed_folder)
    assert ref_weights.keys() == weights.keys()
    assert all(torch.equal(ref_weights[k], weights[k]) for k in ref_weights)


def _checkpoint_position(path) -> tuple[int, int]:
    ckpt = read_checkpoint(path)
    (loader,) = ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    return ckpt["global_step"], loader["epoch"] * BATCHES_PER_EPOCH + loader["batches"]


def test_sigkill_at_a_random_step_then_resume_is_bit_identical(tmp_path, corpus, reference):
    kill_after = random.Random().randint(4, 8)  # JSONL lines: the run is then at least that many steps in
    print(f"killing after {kill_after} logged steps")
    config = _config(tmp_path, corpus)
    proc = launch(config)
    wait_for_lines(tmp_path / "metrics.jsonl", kill_after, proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    step, batches = _checkpoint_position(tmp_path / "ckpt" / "last.ckpt")
    assert 0 < step < MAX_STEPS and batches == step * ACCUMULATE  # saved at an optimizer-step boundary

    finish(launch(config, "--ckpt_path", "last"))
    _assert_continues_exactly(reference, tmp_path, resumed_from=step)


def test_sigterm_finishes_the_step_saves_and_exits_cleanly(tmp_path, corpus, reference):
    config = _config(tmp_path, corpus)
    proc = launch(config)
    wait_for_lines(tmp_path / "metrics.jsonl", 3, proc)
    os.killpg(proc.pid, signal.SIGTERM)
    finish(proc)  # exit code 0
    log = (tmp_path / "run.log").read_text()
    assert "SIGTERM: stopped after step" in log
    step, batches = _checkpoint_position(tmp_path / "ckpt" / "last.ckpt")
    assert 3 <= step < MAX_STEPS and batches == step * ACCUMULATE
    assert (tmp_path / "hf" / "final" / "model.safetensors").is_file()

    (tmp_path / "hf").rename(tmp_path / "hf-stopped")
    finish(launch(config, "--ckpt_path", "last"))
    _assert_continues_exactly(reference, tmp_path, resumed_from=step)
