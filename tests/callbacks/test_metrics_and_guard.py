import json
import math

import lightning as L
import pytest
import torch

from astrai_pl.callbacks import JSONLLogger, NonFiniteGuard, NonFiniteLossError
from astrai_pl.callbacks.metrics import read_jsonl
from astrai_pl.model import ModelConfig
from astrai_pl.objectives import Pretrain


def _batches(n=8):
    torch.manual_seed(1)
    return torch.utils.data.DataLoader(
        [{"input_ids": x, "labels": x} for x in torch.randint(3, 320, (n, 2, 16))], batch_size=None
    )


def _trainer(tmp_path, **kw):
    return L.Trainer(
        accelerator="cpu",
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        **kw,
    )


def test_one_json_line_per_logged_step_with_validation_merged(tmp_path):
    logger = JSONLLogger(save_dir=str(tmp_path))
    trainer = _trainer(
        tmp_path,
        max_steps=4,
        log_every_n_steps=1,
        val_check_interval=2,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        logger=logger,
    )
    trainer.fit(
        Pretrain(arch=ModelConfig.from_name("debug")),
        train_dataloaders=_batches(),
        val_dataloaders=_batches(2),
    )
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 1, 2, 3]
    assert all(isinstance(row["train/loss"], float) for row in rows)
    assert "val/loss" in rows[1] and "val/loss" in rows[3]  # validation at step 1 shares step 1's line
    assert json.loads((tmp_path / "hparams.json").read_text())["arch"]["hidden_size"] == 64
    assert read_jsonl(tmp_path / "metrics.jsonl")[3]["train/loss"] == rows[3]["train/loss"]


class BreaksAtStep(Pretrain):
    def __init__(self, bad_step: int, **kw):
        super().__init__(**kw)
        self.bad_step = bad_step

    def _shared_step(self, batch, stage):
        loss, metrics = super()._shared_step(batch, stage)
        if self.trainer.global_step == self.bad_step:
            metrics["nll"] = metrics["nll"] * math.nan
            loss = loss * math.nan
        return loss, metrics


def test_a_nan_loss_stops_the_run_naming_the_term_and_the_step(tmp_path):
    module = BreaksAtStep(2, arch=ModelConfig.from_name("debug"))
    trainer = _trainer(tmp_path, max_steps=5, logger=False, callbacks=[NonFiniteGuard()])
    with pytest.raises(
        NonFiniteLossError, match=r"optimizer step 2.*train/nll = nan.*lower the learning rate"
    ):
        trainer.fit(module, train_dataloaders=_batches())
    assert all(torch.isfinite(p).all() for p in module.parameters())  # nothing stepped with the NaN
    assert trainer.global_step == 2


def test_a_logged_step_is_on_disk_at_once_and_later_values_of_it_join_its_line(tmp_path):
    logger, path = JSONLLogger(save_dir=str(tmp_path)), tmp_path / "metrics.jsonl"
    logger.log_metrics({"train/loss": 2.5}, step=0)
    logger.log_metrics({"train/loss": 2.25, "lr": 0.001}, step=1)
    rows = [json.loads(line) for line in path.read_text().splitlines()]  # no finalize: as after a SIGKILL
    assert [(row["step"], row["train/loss"]) for row in rows] == [(0, 2.5), (1, 2.25)]
    logger.log_metrics({"val/loss": 2.0}, step=1)
    logger.log_metrics({"lr": 1}, step=1)  # a shorter value: the line stays one valid JSON object
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 1]
    assert rows[1]["val/loss"] == 2.0 and rows[1]["train/loss"] == 2.25 and rows[1]["lr"] == 1


def test_a_resumed_logger_starts_a_new_line_after_one_a_kill_cut_off(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "train/loss": 2.5}\n{"step": 1, "tra')
    JSONLLogger(save_dir=str(tmp_path)).log_metrics({"train/loss": 2.0}, step=1)
    row = json.loads(path.read_text().splitlines()[-1])
    assert row["step"] == 1 and row["train/loss"] == 2.0
