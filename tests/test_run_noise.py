"""A run prints what its user needs and nothing that suggests something is wrong: no third-party tips or
deprecation warnings, no warning about the frozen reference policy's eval mode, no W&B "anonymous" warning,
no CSVLogger warning about the run directory it was given, a progress bar counting optimizer steps (no
`Epoch 0/-2`, no `v_num`), a model summary without `Total FLOPs: 0`, and a missing checkpoint is one line
naming the option that was given."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch

from astrai_pl import warning_filters
from astrai_pl.callbacks.console import ParameterSummary, StepProgressBar, console_settings
from astrai_pl.callbacks.progress import ProgressLines
from astrai_pl.cli import lightning_main, main

ROOT = Path(__file__).resolve().parent.parent
NOISE = (
    "💡 Tip",  # Lightning advertising a hosted logger
    "LeafSpec",  # Lightning's _pytree on torch >= 2.10
    "module(s) in eval mode",  # Lightning on the frozen reference policy
    "anonymous setting",  # wandb on Lightning's anonymous=None
    "JsonargparseDeprecationWarning",
    "add_dataclass_arguments",
    "Traceback",
    "Epoch 0/-",  # Lightning's bar on max_epochs -1
    "v_num",
    "FLOPs",  # the summary's count, 0 without an example_input_array
    "exists and is not empty",  # CSVLogger on the run directory made for it
    "will be deleted",
    "was configured so 1 batch will be used",  # Lightning on limit_val_batches: 1
)
# Output captured to a pipe gets plain progress lines, not a bar; the closing one counts optimizer steps
STEPS_DONE = r"\] done: 2 steps in "


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
    assert re.search(STEPS_DONE, output), output[-2000:]


@pytest.mark.slow
def test_a_debug_grpo_fit_with_a_summary_prints_no_noise(tmp_path):
    output = run_fit(tmp_path, "grpo/debug.yaml", "--trainer.enable_model_summary", "true")
    assert noise_in(output) == [] and "Total params" in output
    assert re.search(STEPS_DONE, output), output[-2000:]  # accumulate_grad_batches: 2


@pytest.mark.slow
def test_a_resumed_sft_fit_prints_no_noise(tmp_path):
    run_fit(tmp_path, "sft/debug.yaml")
    output = run_fit(tmp_path, "sft/debug.yaml", "--trainer.max_steps", "4", "--ckpt_path", "last")
    assert "Restored all states" in output and noise_in(output) == []


class Regression(L.LightningModule):
    """The smallest module a Trainer fits: one linear layer on random rows."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch).pow(2).mean()

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.randn(64, 4), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_the_bar_counts_optimizer_steps_and_the_summary_has_no_flops(tmp_path):
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    summary_log = logging.getLogger("lightning.pytorch.callbacks.model_summary")
    summary_log.addHandler(handler)
    try:
        settings = console_settings({"enable_progress_bar": True}, [], terminal=True)
        trainer = L.Trainer(max_steps=3, max_epochs=-1, accumulate_grad_batches=2, logger=False,
                            enable_checkpointing=False, default_root_dir=tmp_path, **settings)
        trainer.fit(Regression())
    finally:
        summary_log.removeHandler(handler)
    bar = trainer.progress_bar_callback
    assert isinstance(bar, StepProgressBar) and trainer.global_step == 3
    task = bar.progress.tasks[bar.train_progress_bar_id]
    assert (task.completed, task.total) == (3, 3)  # Lightning's bar: 6 batches of a total of 3
    assert task.description.split() == ["Epoch", "0"]  # Lightning's: Epoch 0/-2
    assert "v_num" not in bar.get_metrics(trainer, trainer.lightning_module)
    assert [type(c) for c in trainer.callbacks].count(ParameterSummary) == 1
    assert len(lines) == 1 and "Total params" in lines[0] and "FLOPs" not in lines[0].replace(" ", "")


def test_output_that_is_not_a_terminal_gets_progress_lines_instead_of_a_bar(tmp_path, capsys):
    settings = console_settings({"enable_progress_bar": True}, [], terminal=False)
    assert settings["enable_progress_bar"] is False
    trainer = L.Trainer(max_steps=4, max_epochs=-1, logger=False, enable_checkpointing=False,
                        default_root_dir=tmp_path, **settings)
    trainer.fit(Regression())
    assert trainer.progress_bar_callback is None
    assert [type(c) for c in trainer.callbacks].count(ProgressLines) == 1
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    assert lines and lines[-1].startswith("[regression] done: 4 steps")  # the closing line of the run
    # a config that turns the bar off, or names its own progress callback, gets none added
    assert not any(isinstance(c, ProgressLines) for c in
                   console_settings({"enable_progress_bar": False}, [], terminal=False)["callbacks"])
    mine = ProgressLines(name="mine")
    assert console_settings({}, [mine], terminal=False)["callbacks"].count(mine) == 1


def test_the_run_directorys_csv_logger_keeps_quiet_about_its_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings(record=True) as caught:  # the filters installed here are undone on exit
        warnings.simplefilter("always")
        cli = lightning_main(["--config", str(ROOT / "configs/sft/debug.yaml")], run=False)
        (cli.run_dir / "config.yaml").write_text("as a resumed run finds it\n")
        assert cli.trainer.logger.experiment is not None  # the CSVLogger looks at its directory here
        warnings.warn(f"Experiment logs directory {tmp_path} exists and is not empty.", stacklevel=1)
    assert [str(w.message).split(" exists")[0] for w in caught if "not empty" in str(w.message)] == [
        f"Experiment logs directory {tmp_path}"]  # another directory's warning still shows
    # the CLI's own progress display: output captured by pytest is no terminal, so plain lines, the bar off
    assert cli.trainer.progress_bar_callback is None
    assert [type(c) for c in cli.trainer.callbacks].count(ProgressLines) == 1


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
    one = logging.LogRecord(log.name, logging.INFO, __file__, 1,
                            "`Trainer(limit_val_batches=1)` was configured so 1 batch will be used.", None, None)
    every = logging.LogRecord(log.name, logging.INFO, __file__, 1,
                              "`Trainer(val_check_interval=1)` was configured so validation will run after every "
                              "batch.", None, None)
    assert not log.filter(tip) and not log.filter(one) and log.filter(other) and log.filter(every)


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


def test_torchaos_kernel_and_pytree_notices_are_dropped_and_its_other_messages_kept(monkeypatch):
    import enum

    monkeypatch.setattr(warning_filters, "_installed", False)
    warning_filters.install()
    site = "/venv/lib/python3.11/site-packages/torchao"
    ao, pytree = logging.getLogger("torchao"), logging.getLogger("torch.utils._pytree")

    def record(logger, msg, *args):
        return logging.LogRecord(logger.name, logging.WARNING, __file__, 1, msg, args or None, None)

    for name in ("_C_mxfp8.cpython-310-x86_64-linux-gnu.so", "_C_cutlass_90a.abi3.so"):
        assert not ao.filter(record(ao, f"Failed to load {site}/{name}: Could not load this library: {site}/{name}"))
    assert ao.filter(record(ao, f"Failed to load {site}/_C.abi3.so: undefined symbol"))  # another library: shown
    assert ao.filter(record(ao, "Skipping import of cpp extensions due to incompatible torch version"))
    theirs = enum.Enum("KernelPreference", "AUTO")
    theirs.__module__ = "torchao.quantization.quantize_.common.kernel_preference"
    ours = enum.Enum("Mine", "A")
    assert not pytree.filter(record(pytree, warning_filters.PYTREE_ENUM, theirs))
    assert pytree.filter(record(pytree, warning_filters.PYTREE_ENUM, ours))  # another library's enum: shown


@pytest.mark.slow  # importing peft and transformers takes ~15 s
def test_importing_peft_and_transformers_in_a_verbs_process_prints_nothing():
    code = ("from astrai_pl.verbs import main\ntry:\n    main(['tokenizer', '--help'])\nexcept SystemExit:\n    pass\n"
            "import peft, transformers.modeling_utils\nprint('done')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONWARNINGS": "default"})
    assert done.stdout.strip().endswith("done"), done.stderr[-2000:]
    assert "Failed to load" not in done.stderr and "Enum subclass" not in done.stderr, done.stderr[-2000:]


class _Stream:
    def __init__(self, terminal: bool):
        self.terminal = terminal

    def isatty(self) -> bool:
        return self.terminal


def test_datasets_bars_are_off_for_output_that_is_not_a_terminal(monkeypatch):
    import datasets.utils.tqdm  # noqa: F401 (the module, which datasets.utils' `tqdm` class hides)

    bars = sys.modules["datasets.utils.tqdm"]
    monkeypatch.setattr(bars, "HF_DATASETS_DISABLE_PROGRESS_BARS", None)  # as datasets reads an unset variable
    monkeypatch.setattr(bars, "_hf_datasets_progress_bars_disabled", False)
    env = warning_filters.DATASETS_BARS_ENV
    monkeypatch.delenv(env, raising=False)
    monkeypatch.delitem(sys.modules, "ipykernel", raising=False)  # not a Jupyter kernel (the notebook tests import it)
    assert not warning_filters.library_bars_off_unless_terminal(_Stream(terminal=True)) and env not in os.environ
    assert not bars.are_progress_bars_disabled()
    assert warning_filters.library_bars_off_unless_terminal(_Stream(terminal=False))
    assert os.environ[env] == "1" and bars.are_progress_bars_disabled()  # datasets is imported: off at once
    monkeypatch.setattr(bars, "_hf_datasets_progress_bars_disabled", False)
    monkeypatch.setenv(env, "0")  # the user's choice stands
    warning_filters.library_bars_off_unless_terminal(_Stream(terminal=False))
    assert os.environ[env] == "0" and not bars.are_progress_bars_disabled()
