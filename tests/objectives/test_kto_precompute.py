"""KTO's precompute_ref_log_probs: the reference's log-probabilities of every example and of its mismatched pair,
computed once before training, give the losses, the trained weights and the validation loss of a live frozen
reference; no reference forward runs in a training step, and the tables travel in checkpoints."""

import math
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from fit_runs import quiet_trainer

from astrai_pl.checkpoint import CheckpointError
from astrai_pl.data import Arithmetic, KTOData
from astrai_pl.model import ModelConfig
from astrai_pl.objectives import KTO
from astrai_pl.objectives import kto as kto_module
from astrai_pl.objectives.reference_tables import prepared_tables

ARCH = ModelConfig.from_name("debug", hidden_size=32, intermediate_size=64, num_hidden_layers=1)
SMALL = Arithmetic(train_rows=24, test_rows=8)


class StepRecorder(L.Callback):
    """Each training step's loss, and the example_logps calls made inside training steps."""

    def __init__(self):
        self.losses, self.in_step, self.calls_in_steps = [], False, 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.in_step = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.in_step = False
        self.losses.append(float(outputs["loss"]))


def fit(tmp_path, monkeypatch, loss_type, precompute):
    """Three optimizer steps (two micro-batches each) and a validation pass; the module and its recorder."""
    data = KTOData(synthetic=SMALL, max_seq_len=64, batch_size=4, cache_dir=str(tmp_path), seed=3)
    torch.manual_seed(0)
    module = KTO(arch=ARCH, tokenizer=data.tokenizer, loss_type=loss_type, precompute_ref_log_probs=precompute,
                 optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2))
    recorder = StepRecorder()
    real = kto_module.example_logps

    def counted(model, batch, kl):
        recorder.calls_in_steps += recorder.in_step
        return real(model, batch, kl)

    monkeypatch.setattr(kto_module, "example_logps", counted)
    run = quiet_trainer(devices=1, max_steps=3, accumulate_grad_batches=2, limit_val_batches=2,
                        val_check_interval=6, num_sanity_val_steps=0, callbacks=[recorder])
    run.fit(module, datamodule=data)
    return module, recorder, float(run.callback_metrics["val/loss"])


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
def test_precomputed_and_live_references_train_alike_and_no_reference_runs_in_a_step(tmp_path, monkeypatch,
                                                                                      loss_type):
    live, live_steps, live_val = fit(tmp_path / "live", monkeypatch, loss_type, precompute=False)
    pre, pre_steps, pre_val = fit(tmp_path / "pre", monkeypatch, loss_type, precompute=True)
    assert live_steps.calls_in_steps > 0  # the live reference scores every micro-batch
    assert pre_steps.calls_in_steps == 0 and pre.reference is None
    torch.testing.assert_close(torch.tensor(pre_steps.losses), torch.tensor(live_steps.losses), rtol=1e-5, atol=1e-6)
    for (name, a), b in zip(pre.model.named_parameters(), live.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=name)  # the same gradients, step after step
    assert pre_val == pytest.approx(live_val, rel=1e-5)
    columns = 2 if loss_type == "kto" else 1  # the example, and its mismatched pair for the KL estimate
    assert {k: tuple(v.shape) for k, v in pre.reference_logps.items()} == {"train": (24, columns),
                                                                          "val": (8, columns)}


def test_the_tables_travel_in_checkpoints_and_a_live_checkpoint_is_refused():
    torch.manual_seed(0)
    module = KTO(arch=ARCH, precompute_ref_log_probs=True)
    module.reference_logps = {"train": torch.randn(5, 2), "val": torch.randn(2, 2)}
    checkpoint = {"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}
    module.on_save_checkpoint(checkpoint)
    resumed = KTO(arch=ARCH, precompute_ref_log_probs=True)
    resumed.on_load_checkpoint(checkpoint)
    assert torch.equal(resumed.reference_logps["train"], module.reference_logps["train"])
    del checkpoint["reference_logps"]
    with pytest.raises(CheckpointError, match="no precomputed reference log-probabilities"):
        KTO(arch=ARCH, precompute_ref_log_probs=True).on_load_checkpoint(checkpoint)


@pytest.mark.parametrize("tables", [
    {"train": torch.randn(5, 2), "val": torch.randn(2, 2)},           # saved from other data: 5 rows, not 6
    {"train": torch.randn(6, 2)},                                     # a split missing
    {"train": torch.randn(6, 2), "val": torch.full((3, 2), math.nan)},  # damaged
    {"train": [[0.0, 0.0]] * 6, "val": torch.randn(3, 2)},            # not a tensor
])
def test_a_resumed_table_that_does_not_fit_the_data_is_refused(tables):
    loaders = {"train": SimpleNamespace(dataset=range(6)), "val": SimpleNamespace(dataset=range(3))}
    objective = SimpleNamespace(trainer=SimpleNamespace(datamodule=SimpleNamespace(indexed_loaders=lambda: loaders)))
    with pytest.raises(CheckpointError, match="resume with the data it was trained on"):
        prepared_tables(objective, tables, score=None)
    fitting = {"train": torch.randn(6, 2), "val": torch.randn(3, 2)}
    assert prepared_tables(objective, fitting, score=None) is fitting  # kept as read, not scored again
