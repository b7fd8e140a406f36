import json
import math

import pytest
import torch
from fit_runs import quiet_trainer

from astrai_pl.data import PretrainData
from astrai_pl.model import ModelConfig
from astrai_pl.objectives import Pretrain
from astrai_pl.objectives.base import param_groups
from astrai_pl.objectives.schedules import WarmupCosine, WarmupStableDecay


@pytest.fixture()
def corpus(tmp_path):
    path = tmp_path / "docs.jsonl"
    rows = [{"text": f"Document {i}: the quick brown fox jumps over the lazy dog {i} times."} for i in range(200)]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return str(path)


def trainer(**kw):
    return quiet_trainer(devices=1, **kw)


def test_pretrain_fast_dev_run(corpus):
    data = PretrainData(path=corpus, seq_len=32, batch_size=4)
    module = Pretrain(arch=ModelConfig.from_name("debug"), tokenizer=data.tokenizer)
    trainer(fast_dev_run=2).fit(module, datamodule=data)


def test_pretrain_loss_is_next_token_cross_entropy(corpus):
    torch.manual_seed(0)
    module = Pretrain(arch=ModelConfig.from_name("debug"), label_smoothing=0.0)
    ids = torch.randint(3, 300, (2, 16))
    loss, metrics = module._shared_step({"input_ids": ids, "labels": ids.clone()}, "val")
    logits = module.model(ids).logits
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 320), ids[:, 1:].reshape(-1))
    torch.testing.assert_close(loss, expected)
    assert metrics["tokens"] == 2 * 15


def test_moe_aux_loss_is_added_with_its_coefficient_and_logged_both_ways():
    torch.manual_seed(0)
    arch = ModelConfig.from_name("debug", num_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.5)
    module = Pretrain(arch=arch)
    ids = torch.randint(3, 300, (2, 16))
    loss, metrics = module._shared_step({"input_ids": ids, "labels": ids.clone()}, "train")
    torch.testing.assert_close(metrics["aux_loss_weighted"], 0.5 * metrics["aux_loss"])
    torch.testing.assert_close(loss.detach(), metrics["nll"] + metrics["aux_loss_weighted"])


def test_validation_reports_token_weighted_loss_and_perplexity(corpus):
    data = PretrainData(path=corpus, seq_len=32, batch_size=4, val_fraction=0.2)
    module = Pretrain(arch=ModelConfig.from_name("debug"))
    (metrics,) = trainer().validate(module, datamodule=data, verbose=False)
    assert math.isclose(metrics["val/ppl"], math.exp(metrics["val/loss"]), rel_tol=1e-4)
    assert 5.0 < metrics["val/loss"] < 6.5  # about log(320) for an untrained model


def test_weight_decay_skips_norms_and_biases():
    module = Pretrain(arch=ModelConfig.from_name("debug", attention_bias=True))
    decay, no_decay = param_groups(module.model)
    assert all(p.ndim >= 2 for p in decay["params"]) and all(p.ndim == 1 for p in no_decay["params"])
    assert no_decay["weight_decay"] == 0.0
    optimizer = module.configure_optimizers()
    assert optimizer.param_groups[0]["weight_decay"] == 0.1 and optimizer.param_groups[1]["weight_decay"] == 0.0


def test_schedules_shape():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    cos = WarmupCosine(opt, warmup_steps=10, max_steps=110, min_lr_ratio=0.1)
    assert cos.factor(0) < cos.factor(9) < 1.0
    assert cos.factor(10) == pytest.approx(1.0) and cos.factor(110) == pytest.approx(0.1)
    assert cos.factor(60) == pytest.approx(0.55)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    wsd = WarmupStableDecay(opt, warmup_steps=10, max_steps=100, decay_fraction=0.2, min_lr_ratio=0.0)
    assert wsd.factor(50) == 1.0 and wsd.factor(79) == 1.0
    assert wsd.factor(90) == pytest.approx(0.5) and wsd.factor(100) == 0.0
    with pytest.raises(ValueError, match="decay_fraction"):
        WarmupStableDecay(opt, decay_fraction=0.0)


def test_label_smoothing_out_of_range_is_rejected():
    with pytest.raises(ValueError, match="label_smoothing"):
        Pretrain(arch=ModelConfig.from_name("debug"), label_smoothing=1.0)
