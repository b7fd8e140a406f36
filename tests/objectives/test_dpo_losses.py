"""Every DPO loss type, and TRL's weighted combination of them, against TRL's own `DPOTrainer._compute_loss` on the
same tensors: loss, gradient and metrics."""

from __future__ import annotations

import types
from collections import defaultdict

import pytest
import torch

from astrai_pl.model.config import ConfigError
from astrai_pl.objectives.losses import dpo_loss
from astrai_pl.objectives.options import DPO_LOSS_TYPES, DPO_SMOOTHED

B, T = 6, 7  # pairs, positions (position 0 is the prompt's)


def case(seed: int = 0):
    """Per-token log-probabilities of 2B responses (chosen first), their completion mask, and the reference's
    summed log-probabilities of each side."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T, (2 * B,), generator=gen)
    mask = (torch.arange(T) >= 1) & (torch.arange(T) <= lengths[:, None])  # (2B, T)
    per_token = -torch.rand(2 * B, T - 1, generator=gen, dtype=torch.float64) * 4  # (2B, T - 1)
    ref = (per_token * mask[:, 1:]).sum(1) + torch.randn(2 * B, generator=gen, dtype=torch.float64) * 2
    return per_token, mask.to(torch.long), ref[:B], ref[B:]


def trl_dpo(trl_dpo_module, per_token, mask, ref_chosen, ref_rejected, loss_type, loss_weights=None, beta=0.3,
            label_smoothing=0.0, discopop_tau=0.05):
    """TRL's loss: `DPOTrainer._compute_loss` on a stand-in trainer (one process, precomputed reference) whose
    model returns `per_token` as the tokens' log-probabilities."""
    types_ = [loss_type] if isinstance(loss_type, str) else loss_type

    def model(input_ids, **kwargs):
        zeros = torch.zeros_like(per_token)
        return types.SimpleNamespace(log_probs=per_token, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool())

    stand_in = types.SimpleNamespace(
        model=types.SimpleNamespace(training=True), aux_loss_enabled=False, ld_alpha=None,
        accelerator=types.SimpleNamespace(device=torch.device("cpu"), gather=lambda x: x, gather_for_metrics=lambda x: x),
        precompute_ref_logps=True, f_divergence_type="reverse_kl", loss_types=types_,
        loss_weights=loss_weights or [1.0] * len(types_), beta=beta, label_smoothing=label_smoothing,
        args=types.SimpleNamespace(discopop_tau=discopop_tau), use_weighting=False,
        _metrics=defaultdict(lambda: defaultdict(list)), _total_train_tokens=0, _tp_size=1)
    inputs = {"input_ids": torch.zeros_like(mask), "attention_mask": torch.ones_like(mask), "completion_mask": mask,
              "ref_chosen_logps": ref_chosen, "ref_rejected_logps": ref_rejected}
    loss = trl_dpo_module.DPOTrainer._compute_loss(stand_in, model, inputs, return_outputs=False)
    return loss, stand_in._metrics["train"]


def ours(per_token, mask, ref_chosen, ref_rejected, loss_type, **options):
    """dpo_loss fed as the DPO objective feeds it: summed log-probabilities, lengths, the chosen token-mean NLL."""
    scored = mask[:, 1:].to(per_token.dtype)
    chosen, rejected = (per_token * scored).sum(1).chunk(2)
    chosen_len, rejected_len = scored.sum(1).chunk(2)
    nll = -chosen.sum() / chosen_len.sum()
    return dpo_loss(chosen, rejected, ref_chosen, ref_rejected, loss_type=loss_type, chosen_lengths=chosen_len,
                    rejected_lengths=rejected_len, chosen_nll=nll, **options)


@pytest.fixture(scope="module")
def trl_dpo_module():
    return pytest.importorskip("trl.trainer.dpo_trainer")


CASES = [(name, 0.0) for name in DPO_LOSS_TYPES if name != "exo_pair"]
CASES += [(name, 0.1) for name in DPO_SMOOTHED if name != "sigmoid"]  # TRL ≥ 1.0 smooths these, not sigmoid
CASES += [(["sigmoid", "bco_pair", "sft"], 0.0), (["ipo", "sigmoid_norm", "aot"], 0.2)]  # MPO-style sums


@pytest.mark.parametrize("loss_type,label_smoothing", CASES, ids=str)
def test_loss_gradient_and_metrics_equal_trls(trl_dpo_module, loss_type, label_smoothing):
    per_token, mask, ref_chosen, ref_rejected = case(seed=len(str(loss_type)))
    weights = [0.8, 0.2, 1.0] if isinstance(loss_type, list) else None
    options = dict(beta=0.3, label_smoothing=label_smoothing, loss_weights=weights)
    theirs_leaf = per_token.clone().requires_grad_(True)
    theirs, their_metrics = trl_dpo(trl_dpo_module, theirs_leaf * mask[:, 1:], mask, ref_chosen, ref_rejected,
                                    loss_type, **options)
    theirs.backward()
    ours_leaf = per_token.clone().requires_grad_(True)
    loss, metrics = ours(ours_leaf, mask, ref_chosen, ref_rejected, loss_type, **options)
    loss.backward()
    tol = 1e-7 if "exo_pair" in loss_type else 1e-9  # TRL takes log ε and log(1 − ε) in float32
    torch.testing.assert_close(loss, theirs, rtol=tol, atol=tol)
    assert ours_leaf.grad.abs().sum() > 0
    torch.testing.assert_close(ours_leaf.grad, theirs_leaf.grad, rtol=tol, atol=tol)
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen"):
        assert float(metrics[name]) == pytest.approx(their_metrics[name][-1], rel=1e-6), name  # TRL: float32 accuracies


def test_discopop_temperature_reaches_the_loss(trl_dpo_module):
    per_token, mask, ref_chosen, ref_rejected = case(seed=3)
    theirs, _ = trl_dpo(trl_dpo_module, per_token * mask[:, 1:], mask, ref_chosen, ref_rejected, "discopop",
                        discopop_tau=0.5)
    loss, _ = ours(per_token, mask, ref_chosen, ref_rejected, "discopop", beta=0.3, discopop_tau=0.5)
    default, _ = ours(per_token, mask, ref_chosen, ref_rejected, "discopop", beta=0.3)
    torch.testing.assert_close(loss, theirs, rtol=1e-9, atol=1e-9)
    assert abs(float(loss - default)) > 1e-3


def test_combination_reports_each_part_and_weighs_them():
    per_token, mask, ref_chosen, ref_rejected = case(seed=5)
    both, metrics = ours(per_token, mask, ref_chosen, ref_rejected, ["sigmoid", "sft"], loss_weights=[2.0, 0.5])
    sigmoid, _ = ours(per_token, mask, ref_chosen, ref_rejected, "sigmoid")
    sft, _ = ours(per_token, mask, ref_chosen, ref_rejected, "sft")
    torch.testing.assert_close(both, 2.0 * sigmoid + 0.5 * sft)
    torch.testing.assert_close(metrics["loss/sft"], sft)


@pytest.mark.parametrize("kwargs,match", [
    ({"loss_type": "aot_pair"}, "aot_unpaired"),
    ({"loss_type": "exo_pair"}, "exo_pair"),
    ({"loss_type": ["sigmoid", "ipo"], "loss_weights": [1.0]}, "loss_weights"),
    ({"loss_type": ["sigmoid", "sigmoid"]}, "twice"),
    ({"loss_type": "bco_pair", "label_smoothing": 0.1}, "label_smoothing"),
    ({"loss_type": "discopop", "discopop_tau": 0.0}, "discopop_tau"),
])
def test_bad_options_are_refused_with_the_fix(kwargs, match):
    side = -torch.rand(4, dtype=torch.float64) * 10
    with pytest.raises(ConfigError, match=match):
        dpo_loss(side, side - 1, side, side, **kwargs)


@pytest.mark.parametrize("loss_type,missing", [("sigmoid_norm", "chosen_lengths"), ("sft", "chosen_nll")])
def test_loss_types_that_need_more_than_sums_say_what(loss_type, missing):
    side = -torch.rand(4, dtype=torch.float64) * 10
    with pytest.raises(ValueError, match=missing):
        dpo_loss(side, side - 1, side, side, loss_type=loss_type)
