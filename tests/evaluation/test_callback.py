"""The Evaluate callback: metrics and a samples table to every logger, rank 0 only, failures on every rank,
and a two-process DDP run that neither deadlocks nor loses the metrics."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from astrai_pl.callbacks.evaluate import Evaluate, EvaluationError, metric_values
from astrai_pl.model import ModelConfig, Transformer
from astrai_pl.tokenizer import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fit_runs import debug_config, finish, launch, write_corpus  # noqa: E402


class Recorder:
    def __init__(self):
        self.metrics, self.tables = [], []

    def log_metrics(self, metrics, step):
        self.metrics.append((step, metrics))

    def log_table(self, key, columns, data, step):
        self.tables.append((key, columns, data, step))


class Strategy:
    def __init__(self, broadcast_value=None):
        self.calls, self.broadcast_value = [], broadcast_value

    def barrier(self, name=None):
        self.calls.append("barrier")

    def broadcast(self, obj, src=0):
        self.calls.append("broadcast")
        return obj if self.broadcast_value is None else self.broadcast_value


def fake_run(rank_zero: bool, step: int = 3, strategy=None):
    torch.manual_seed(0)
    module = SimpleNamespace(model=Transformer(ModelConfig.from_name("debug")).train(),
                             tokenizer=Tokenizer.byte_level())
    logger = Recorder()
    trainer = SimpleNamespace(global_step=step, is_global_zero=rank_zero, loggers=[logger],
                              strategy=strategy or Strategy())
    return trainer, module, logger


def test_every_metric_and_the_samples_go_to_the_loggers_and_the_model_trains_on():
    callback = Evaluate(tasks=["astrai_arithmetic", "astrai_next_sentence"], limit=2, max_total_tokens=4096)
    trainer, module, logger = fake_run(rank_zero=True)
    callback.run(trainer, module)
    [(step, metrics)] = logger.metrics
    assert step == 3 and {"eval/astrai_arithmetic/exact_match/last_integer", "eval/astrai_next_sentence/acc",
                          "eval/astrai_next_sentence/acc_norm"} <= set(metrics)
    [(key, columns, rows, _)] = logger.tables
    assert key == "eval/samples" and columns[:4] == ["step", "task", "doc_id", "prompt"] and len(rows) == 4
    assert rows[0][3].startswith("What is ") and module.model.training
    assert trainer.strategy.calls == ["barrier", "broadcast"] and callback.history[0]["step"] == 3


def test_other_ranks_only_wait_and_learn_of_a_failure_on_rank_zero():
    callback = Evaluate(tasks=["astrai_arithmetic"], limit=1)
    trainer, module, logger = fake_run(rank_zero=False)
    callback.run(trainer, module)
    assert logger.metrics == [] and trainer.strategy.calls == ["barrier", "broadcast"]
    trainer, module, _ = fake_run(rank_zero=False, strategy=Strategy("KeyError: 'no_such_task'"))
    with pytest.raises(EvaluationError, match="failed on rank 0: KeyError"):
        callback.run(trainer, module)


def test_a_failure_on_rank_zero_still_meets_the_barrier_and_stops_with_the_error():
    callback = Evaluate(tasks=["not_a_local_task"], limit=1, include_path=["/nonexistent-folder"],
                        trust_task_code=True)
    trainer, module, _ = fake_run(rank_zero=True)
    callback.evaluate = lambda pl_module: (_ for _ in ()).throw(KeyError("not_a_local_task"))
    with pytest.raises(EvaluationError, match="not_a_local_task"):
        callback.run(trainer, module)
    assert trainer.strategy.calls == ["barrier", "broadcast"]


@pytest.mark.parametrize("kwargs, field", [({"tasks": []}, "tasks"), ({"every_n_steps": 0}, "every_n_steps"),
                                           ({"limit": 0}, "limit")])
def test_bad_settings_are_refused_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"Evaluate.{field}"):
        Evaluate(**{"tasks": ["astrai_arithmetic"], **kwargs})


def test_metric_names_drop_the_none_filter_and_non_numbers():
    results = {"results": {"t": {"alias": "t", "acc,none": 0.5, "acc_stderr,none": "N/A", "em,last": 1}}}
    assert metric_values(results) == {"eval/t/acc": 0.5, "eval/t/em/last": 1.0}


@pytest.mark.slow
def test_two_ddp_processes_evaluate_on_rank_zero_without_deadlock(tmp_path):
    corpus = write_corpus(tmp_path / "corpus.txt")
    evaluate = {"class_path": "astrai_pl.callbacks.evaluate.Evaluate",
                "init_args": {"tasks": ["astrai_next_sentence"], "every_n_steps": 2, "limit": 2,
                              "max_total_tokens": 4096}}
    config = debug_config(tmp_path / "run", corpus, max_steps=3, batch_size=4, strategy="ddp", devices=2,
                          extra_callbacks=[evaluate])
    finish(launch(config), timeout=240)
    rows = [json.loads(line) for line in (config.parent / "metrics.jsonl").read_text().splitlines()]
    steps = sorted(r["step"] for r in rows if "eval/astrai_next_sentence/acc" in r)
    assert steps == [2, 3]  # every 2 steps and when training ends


@pytest.mark.slow
def test_wandb_gets_the_metrics_and_a_samples_table_offline(tmp_path, monkeypatch):
    from lightning.pytorch.loggers import WandbLogger

    for name in ("WANDB_API_KEY", "WANDB_BASE_URL", "WANDB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    logger = WandbLogger(save_dir=str(tmp_path), offline=True, project="eval-test")
    trainer, module, _ = fake_run(rank_zero=True)
    trainer.loggers = [logger]
    Evaluate(tasks=["astrai_next_sentence"], limit=2, max_total_tokens=4096).run(trainer, module)
    logger.experiment.finish()
    [table] = tmp_path.rglob("samples_*.table.json")
    data = json.loads(table.read_text())
    assert data["columns"][:2] == ["step", "task"] and len(data["data"]) == 2
