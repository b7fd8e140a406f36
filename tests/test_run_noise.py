"""A run prints what its user needs and nothing that suggests something is wrong: no third-party tips or
deprecation warnings, no warning about the frozen reference policy's eval mode, no W&B "anonymous" warning,
and a missing checkpoint is one line naming the option that was given."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from astrai_pl import warning_filters
from astrai_pl.cli import main

ROOT = Path(__file__).resolve().parent.parent
NOISE = (
    "💡 Tip",  # Lightning advertising a hosted logger
    "LeafSpec",  # Lightning's _pytree on torch >= 2.10
    "module(s) in eval mode",  # Lightning on the frozen reference policy
    "anonymous setting",  # wandb on Lightning's anonymous=None
    "JsonargparseDeprecationWarning",
    "add_dataclass_arguments",
    "Traceback",
)


def run_fit(tmp_path: Path, config: str, *extra: str) -> str:
    """`astrai-pl fit` on a shipped config in a fresh process (its runs/ in tmp_path); stdout + stderr."""
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "false", "PYTHONWARNINGS": "default"}
    done = subprocess.run(
        [sys.executable, "-m", "astrai_pl.cli", "fit", "--config", str(ROOT / "configs" / config),
         "--trainer.max_steps", "2", *extra],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    return output


def noise_in(output: str) -> list[str]:
    return [line for line in output.splitlines() if any(noise in line for noise in NOISE)]


@pytest.mark.slow
def test_a_debug_pretrain_fit_with_wandb_prints_no_noise(tmp_path):
    output = run_fit(tmp_path, "pretrain/debug.yaml", "--wandb.enabled", "true")
    assert "max_steps=2" in output  # the run did run
    assert noise_in(output) == []


@pytest.mark.slow
def test_a_debug_grpo_fit_prints_no_noise(tmp_path):
    assert noise_in(run_fit(tmp_path, "grpo/debug.yaml")) == []


def test_the_filters_drop_the_known_messages_and_keep_others(monkeypatch):
    with warnings.catch_warnings(record=True) as caught:  # the filters installed here are undone on exit
        warnings.simplefilter("always")
        monkeypatch.setattr(warning_filters, "_installed", False)
        warning_filters.install()
        warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated, use TreeSpec", FutureWarning, stacklevel=1)
        warnings.warn("Found 30 module(s) in eval mode at the start of training. This may lead", stacklevel=1)
        warnings.warn("a warning of our own", UserWarning, stacklevel=1)
        for module in ("lightning.pytorch.cli", "astrai_pl.cli"):  # a deprecated call in Lightning's CLI, in ours
            warnings.warn_explicit("skip_none parameter was deprecated", DeprecationWarning, "cli.py", 1, module)
    assert [str(w.message) for w in caught] == ["a warning of our own", "skip_none parameter was deprecated"]
    log = logging.getLogger(warning_filters.RANK_ZERO_LOGGERS[0])
    tip = logging.LogRecord(log.name, logging.INFO, __file__, 1, "💡 Tip: try a service", None, None)
    other = logging.LogRecord(log.name, logging.INFO, __file__, 1, "GPU available: False", None, None)
    assert not log.filter(tip) and log.filter(other)


@pytest.mark.slow
def test_the_filters_are_in_place_once_the_cli_is_imported():
    done = subprocess.run(
        [sys.executable, "-c", "import warnings, astrai_pl.cli; "
         "warnings.warn('`isinstance(treespec, LeafSpec)` is deprecated', FutureWarning); print('done')"],
        capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "done" and "LeafSpec" not in done.stderr


@pytest.mark.parametrize("verb,option", [("convert", "--ckpt"), ("generate", "--model")])
def test_a_missing_checkpoint_is_one_line_naming_the_option(tmp_path, verb, option):
    missing = tmp_path / "runs" / "last.ckpt"
    extra = ["--output", str(tmp_path / "hf")] if verb == "convert" else ["--prompt", "hi"]
    with pytest.raises(SystemExit) as stop:
        main([verb, option, str(missing), *extra])
    message = str(stop.value.code)
    assert message.count("\n") == 0 and f"{option} {missing}: no such file or directory" in message
    assert "init_from" not in message
