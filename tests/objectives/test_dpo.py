import json
import logging
import math

import lightning as L
import pytest
import torch
from fit_runs import quiet_trainer

from astrai_pl.checkpoint import CheckpointError
from astrai_pl.data import Arithmetic, DataError, DPOData
from astrai_pl.model import ModelConfig
from astrai_pl.model.config import ConfigError
from astrai_pl.objectives import DPO
from astrai_pl.objectives.dpo import pair_logps

ARCH = ModelConfig.from_name("debug", hidden_size=32, intermediate_size=64, num_hidden_layers=1)
SMALL = Arithmetic(train_rows=48, test_rows=8)


def trainer(**kw):
    return quiet_trainer(devices=1, **kw)


def pairs(tmp_path, batch_size=4):
    return DPOData(synthetic=SMALL, max_seq_len=64, batch_size=batch_size, cache_dir=str(tmp_path))


def module(seed=0, **kw):
    torch.manual_seed(seed)
    adam = lambda params: torch.optim.AdamW(params, lr=1e-2)  # noqa: E731 - large: weights move visibly
    return DPO(arch=ARCH, optimizer=adam, **kw)


class LossRecorder(L.Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def test_the_reference_is_frozen_outside_the_trainable_state_and_unchanged_by_a_fit(tmp_path):
    data = pairs(tmp_path)
    dpo = module(tokenizer=data.tokenizer)
    before = {n: p.detach().clone() for n, p in dpo.reference.named_parameters()}
    policy_before = {n: p.detach().clone() for n, p in dpo.model.named_parameters()}
    recorder = LossRecorder()
    run = trainer(max_steps=4, limit_val_batches=1, val_check_interval=2, callbacks=[recorder])
    run.fit(dpo, datamodule=data)

    assert not dpo.reference.training and all(not p.requires_grad for p in dpo.reference.parameters())
    for name, p in dpo.reference.named_parameters():
        assert p.grad is None and torch.equal(p, before[name]), name
    assert any(not torch.equal(p, policy_before[n]) for n, p in dpo.model.named_parameters())
    assert recorder.losses[0] == pytest.approx(math.log(2), abs=1e-6)  # policy == reference at step 0
    optimized = {id(p) for group in run.optimizers[0].param_groups for p in group["params"]}
    assert optimized == {id(p) for p in dpo.model.parameters()}
    assert not any(k.startswith("reference") for k in dpo.state_dict())
    assert len(list(dpo.parameters())) == len(list(dpo.model.parameters()))


def test_precomputed_and_live_reference_give_the_same_losses(tmp_path):
    runs = {}
    for precompute in (False, True):
        data = pairs(tmp_path)
        dpo = module(tokenizer=data.tokenizer, precompute_ref_log_probs=precompute)
        recorder = LossRecorder()
        run = trainer(max_steps=3, limit_val_batches=2, val_check_interval=3, callbacks=[recorder])
        run.fit(dpo, datamodule=data)
        runs[precompute] = (recorder.losses, float(run.callback_metrics["val/loss"]), dpo)
    (live, live_val, _), (pre, pre_val, dpo) = runs[False], runs[True]
    assert live[0] == pytest.approx(math.log(2), abs=1e-6)
    torch.testing.assert_close(torch.tensor(pre), torch.tensor(live), rtol=1e-5, atol=1e-6)
    assert pre_val == pytest.approx(live_val, rel=1e-5)
    assert dpo.reference is None and set(dpo.reference_logps) == {"train", "val"}
    assert len(dpo.reference_logps["train"]) == len(data.train_set)


def test_fast_dev_run_on_cpu_with_accumulation(tmp_path):
    data = pairs(tmp_path, batch_size=3)
    trainer(fast_dev_run=2, accumulate_grad_batches=2).fit(module(tokenizer=data.tokenizer), datamodule=data)


def test_the_per_pair_mean_is_exact_under_accumulation(tmp_path):
    data = pairs(tmp_path)
    data.setup()
    dpo = module()
    batch = next(iter(data.val_dataloader()))
    dpo.model.lm_head.weight.data.add_(0.1)  # policy != reference: a loss other than log 2
    alone, _ = dpo._shared_step(batch, "train")
    tagged, _ = dpo._shared_step({**batch, "window_pairs": 3 * len(batch["row_index"])}, "train")
    torch.testing.assert_close(tagged, alone / 3)  # K = 1 (no trainer): this batch is a third of its window


@pytest.mark.parametrize("loss_type", ["ipo", "sigmoid_norm", ["sigmoid", "ipo"]])
def test_ipo_and_sigmoid_norm_score_responses_by_their_mean_token_log_probability(tmp_path, loss_type):
    data = pairs(tmp_path)
    data.setup()
    batch = next(iter(data.val_dataloader()))
    dpo = module(loss_type=loss_type, beta=0.1)
    with torch.no_grad():
        dpo.model.lm_head.weight.add_(0.05 * torch.randn_like(dpo.model.lm_head.weight))  # policy ≠ reference
    loss, metrics = dpo._shared_step(batch, "val")
    (chosen, rejected), (ref_chosen, ref_rejected) = pair_logps(dpo.model, batch), pair_logps(dpo.reference, batch)
    tokens = [(batch[f"{side}_labels"][:, 1:] != -100).sum(1) for side in ("chosen", "rejected")]
    assert len(set(tokens[0].tolist())) > 1
    h_mean = (chosen - ref_chosen) / tokens[0] - (rejected - ref_rejected) / tokens[1]  # (B,)
    ipo = ((h_mean - 1 / (2 * 0.1)) ** 2).mean()
    sigmoid_norm = -torch.nn.functional.logsigmoid(0.1 * h_mean).mean()
    h = (chosen - ref_chosen) - (rejected - ref_rejected)
    expected = {"ipo": ipo, "sigmoid_norm": sigmoid_norm}.get(loss_type if isinstance(loss_type, str) else "",
                                                              ipo - torch.nn.functional.logsigmoid(0.1 * h).mean())
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(metrics["logps/chosen"], chosen.mean())  # TRL's: summed log-probabilities


def test_rpo_alpha_adds_the_token_mean_nll_of_the_chosen_responses(tmp_path):
    data = pairs(tmp_path)
    data.setup()
    batch = next(iter(data.val_dataloader()))
    dpo = module(rpo_alpha=0.5)
    loss, metrics = dpo._shared_step(batch, "val")
    chosen, _ = pair_logps(dpo.model, batch)
    nll = -chosen.sum() / (batch["chosen_labels"][:, 1:] != -100).sum()
    torch.testing.assert_close(metrics["nll_loss"], nll.detach())
    torch.testing.assert_close(loss, math.log(2) + 0.5 * nll)


@pytest.mark.parametrize("options, match", [
    ({"beta": 0.0}, r"DPO\.beta=0\.0: must be > 0"),
    ({"beta": -0.1}, r"DPO\.beta=-0\.1"),
    ({"loss_type": "kto"}, r"DPO\.loss_type='kto': unknown; use one of sigmoid, robust, ipo, hinge"),
    ({"label_smoothing": 0.5}, r"DPO\.label_smoothing=0\.5: must lie in \[0, 0\.5\)"),
    ({"loss_type": "ipo", "label_smoothing": 0.1}, r"only sigmoid, robust, exo_pair, aot, aot_unpaired use it"),
    ({"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 2.0, 3.0]}, r"DPO\.loss_weights=.*one weight per"),
    ({"rpo_alpha": -1.0}, r"DPO\.rpo_alpha=-1\.0: must be >= 0"),
])
def test_bad_options_fail_at_construction(options, match):
    with pytest.raises(ConfigError, match=match):
        DPO(arch=ARCH, **options)


def identical_pair_file(tmp_path):
    rows = [{"prompt": f"Pick {i}.", "chosen": " yes", "rejected": " no"} for i in range(12)]
    rows[6]["rejected"] = rows[6]["chosen"]
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_a_pair_whose_chosen_equals_its_rejected_stops_the_run_before_step_1(tmp_path):
    data = DPOData(path=identical_pair_file(tmp_path), val_split=None, val_fraction=0.2, batch_size=2)
    dpo = module(tokenizer=data.tokenizer)
    run = trainer(max_steps=2)
    with pytest.raises(DataError, match=r"pairs\.jsonl, line 7, field 'rejected': chosen and rejected are the"):
        run.fit(dpo, datamodule=data)
    assert run.global_step == 0


def test_with_on_bad_row_skip_the_identical_pair_is_dropped_and_counted(tmp_path, caplog):
    data = DPOData(path=identical_pair_file(tmp_path), val_fraction=0.2, batch_size=2, on_bad_row="skip")
    with caplog.at_level(logging.WARNING):
        data.setup()
    assert "skipped 1 bad row(s)" in caplog.text and "chosen equals rejected" in caplog.text
    assert len(data.train_set) + len(data.val_set) == 11


def test_checkpoints_leave_the_reference_out_and_refuse_another_one(tmp_path):
    dpo = module(seed=0)
    checkpoint = {"state_dict": dpo.state_dict(), "hyper_parameters": dict(dpo.hparams)}
    dpo.on_save_checkpoint(checkpoint)
    assert all(k.startswith(("model.", "val_loss")) for k in checkpoint["state_dict"])
    module(seed=0).on_load_checkpoint(checkpoint)  # the same initial weights: resumes
    with pytest.raises(CheckpointError, match="is not the one this run trained against"):
        module(seed=1).on_load_checkpoint(checkpoint)
    with pytest.raises(CheckpointError, match="no precomputed reference log-probabilities"):
        module(precompute_ref_log_probs=True).on_load_checkpoint(checkpoint)
