"""KTO, ORPO, SimPO and the Bradley–Terry loss against their papers' formulas, computed by hand, and against TRL's
own loss code called on the same numbers (without a trainer: its loss methods run on a stand-in `self`)."""

import math
import types
from collections import defaultdict

import pytest
import torch

from astrai_pl.model.config import ConfigError
from astrai_pl.objectives.losses import bradley_terry_loss, kto_loss, orpo_loss, simpo_loss


def sigmoid(x):
    return 1 / (1 + math.exp(-x))


def case(seed=0, n=6, low=-9.0, high=-0.2):
    gen = torch.Generator().manual_seed(seed)
    return [low + (high - low) * torch.rand(n, generator=gen, dtype=torch.float64) for _ in range(4)]


# -- hand-computed --------------------------------------------------------------------------------------


def test_kto_follows_eq_7_with_the_clamped_mismatched_pair_estimate():
    policy = torch.tensor([-3.0, -5.0, -4.0], dtype=torch.float64)
    ref = torch.tensor([-3.5, -4.0, -4.0], dtype=torch.float64)
    desirable = torch.tensor([True, False, True])
    kl_policy, kl_ref = torch.tensor([-6.0, -7.0], dtype=torch.float64), torch.tensor([-6.4, -7.2], dtype=torch.float64)
    beta, wd, wu = 0.5, 1.5, 0.8
    loss, metrics = kto_loss(policy, ref, desirable, kl_policy, kl_ref, beta=beta, desirable_weight=wd,
                             undesirable_weight=wu)
    z0 = (0.4 + 0.2) / 2
    expected = (wd * (1 - sigmoid(beta * (0.5 - z0))) + wu * (1 - sigmoid(beta * (z0 - (-1.0))))
                + wd * (1 - sigmoid(beta * (0.0 - z0)))) / 3
    assert float(loss) == pytest.approx(expected, rel=1e-12)
    assert float(metrics["kl"]) == pytest.approx(z0)
    assert float(metrics["rewards/chosen"]) == pytest.approx(beta * (0.5 + 0.0) / 2)
    assert float(metrics["rewards/rejected"]) == pytest.approx(beta * -1.0)
    assert float(metrics["logps/chosen"]) == pytest.approx(-3.5)


def test_kto_reference_point_is_clamped_at_zero_and_takes_no_gradient():
    policy = torch.tensor([-3.0, -2.0], dtype=torch.float64, requires_grad=True)
    kl_policy = torch.tensor([-8.0, -8.0], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-3.0, -2.0], dtype=torch.float64)
    loss, metrics = kto_loss(policy, ref, torch.tensor([True, False]), kl_policy, kl_policy.detach() + 1.0)
    assert float(metrics["kl"]) == 0.0  # the mean log-ratio is -1: clamped
    assert float(loss.detach()) == pytest.approx(0.5)  # r = z0 = 0: 1 - σ(0) on both sides
    loss.backward()
    assert kl_policy.grad is None and policy.grad is not None
    assert float(policy.grad[0]) < 0 < float(policy.grad[1])  # desirable pushed up, undesirable down


def test_kto_metrics_leave_out_a_kind_the_batch_lacks():
    policy, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -2.5])
    _, metrics = kto_loss(policy, ref, torch.tensor([True, True]), policy, ref)
    assert "rewards/chosen" in metrics and "rewards/rejected" not in metrics and "rewards/margins" not in metrics


def test_apo_zero_unpaired_needs_no_mismatched_pairs():
    policy, ref = torch.tensor([-1.0, -2.0], dtype=torch.float64), torch.tensor([-1.5, -1.0], dtype=torch.float64)
    loss, metrics = kto_loss(policy, ref, torch.tensor([True, False]), None, None, beta=0.2,
                             loss_type="apo_zero_unpaired")
    assert float(loss) == pytest.approx(((1 - sigmoid(0.2 * 0.5)) + sigmoid(0.2 * -1.0)) / 2, rel=1e-12)
    with pytest.raises(ValueError, match="mismatched pairs"):
        kto_loss(policy, ref, torch.tensor([True, False]), None, None)


def test_orpo_is_the_nll_minus_beta_log_sigmoid_of_the_log_odds_ratio():
    chosen, rejected = torch.tensor([-0.3], dtype=torch.float64), torch.tensor([-1.2], dtype=torch.float64)
    nll = torch.tensor(0.7, dtype=torch.float64)
    loss, metrics = orpo_loss(chosen, rejected, nll, beta=0.25)
    pc, pr = math.exp(-0.3), math.exp(-1.2)
    log_or = math.log(pc / (1 - pc)) - math.log(pr / (1 - pr))
    assert float(metrics["log_odds_chosen"]) == pytest.approx(log_or, rel=1e-12)
    assert float(loss) == pytest.approx(0.7 - 0.25 * math.log(sigmoid(log_or)), rel=1e-12)
    assert float(metrics["rewards/chosen"]) == pytest.approx(0.25 * -0.3)


def test_orpo_stays_finite_for_a_response_of_probability_one():
    chosen = torch.tensor([0.0, -1e-9], requires_grad=True)
    loss, _ = orpo_loss(chosen, torch.tensor([-2.0, -2.0]), torch.tensor(0.0))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(chosen.grad).all()


def test_simpo_is_a_margin_loss_on_length_normalised_rewards():
    chosen, rejected = torch.tensor([-0.5, -2.0], dtype=torch.float64), torch.tensor([-1.5, -1.0], dtype=torch.float64)
    loss, metrics = simpo_loss(chosen, rejected, beta=2.0, gamma=0.6, label_smoothing=0.1)

    def one(delta):
        h = 2.0 * delta - 0.6
        return -0.9 * math.log(sigmoid(h)) - 0.1 * math.log(sigmoid(-h))

    assert float(loss) == pytest.approx((one(1.0) + one(-1.0)) / 2, rel=1e-12)
    assert float(metrics["rewards/accuracies"]) == 0.5
    assert float(metrics["rewards/margins"]) == pytest.approx(0.0)


def test_bradley_terry_with_margin_and_centring():
    chosen, rejected = torch.tensor([1.0, -0.5], dtype=torch.float64), torch.tensor([0.2, 0.5], dtype=torch.float64)
    loss, metrics = bradley_terry_loss(chosen, rejected, margin=torch.tensor([0.3, 0.0], dtype=torch.float64),
                                       center_rewards_coefficient=0.1)
    expected = -(math.log(sigmoid(0.8 - 0.3)) + math.log(sigmoid(-1.0))) / 2 + 0.1 * (1.2 ** 2 + 0.0 ** 2) / 2
    assert float(loss) == pytest.approx(expected, rel=1e-12)
    assert float(metrics["accuracy"]) == 0.5 and float(metrics["margin"]) == pytest.approx(-0.1)
    assert (float(metrics["min_reward"]), float(metrics["max_reward"])) == (-0.5, 1.0)


@pytest.mark.parametrize("call, match", [
    (lambda: kto_loss(*case()[:2], torch.ones(6, dtype=torch.bool), None, None, beta=0.0), "KTO.beta"),
    (lambda: kto_loss(*case()[:2], torch.ones(6, dtype=torch.bool), None, None, loss_type="bco"), "KTO.loss_type"),
    (lambda: kto_loss(*case()[:2], torch.ones(6, dtype=torch.bool), None, None, desirable_weight=-1), "desirable"),
    (lambda: orpo_loss(*case()[:2], torch.tensor(1.0), beta=-0.1), "ORPO.beta"),
    (lambda: simpo_loss(*case()[:2], gamma=-1.0), "SimPO.gamma"),
    (lambda: simpo_loss(*case()[:2], label_smoothing=0.5), "SimPO.label_smoothing"),
    (lambda: bradley_terry_loss(*case()[:2], center_rewards_coefficient=-0.01), "center_rewards_coefficient"),
])
def test_bad_options_name_the_option(call, match):
    with pytest.raises(ConfigError, match=match):
        call()


def test_mismatched_shapes_are_refused():
    with pytest.raises(ValueError, match="one shape"):
        simpo_loss(torch.zeros(3), torch.zeros(2))


# -- against TRL's loss code ----------------------------------------------------------------------------


class Accelerator:
    """What TRL's loss methods ask of an accelerate.Accelerator, on one process."""

    device = torch.device("cpu")

    @staticmethod
    def gather_for_metrics(x):
        return x

    gather = gather_for_metrics


def test_orpo_equals_trl_odds_ratio_loss():
    orpo = pytest.importorskip("trl.experimental.orpo")
    chosen, rejected = case(1)[:2]
    nll = torch.tensor(1.3, dtype=torch.float64)
    stand_in = types.SimpleNamespace(beta=0.3, accelerator=Accelerator())
    losses, chosen_rewards, rejected_rewards, ratio, log_odds = orpo.ORPOTrainer.odds_ratio_loss(
        stand_in, chosen, rejected)
    loss, metrics = orpo_loss(chosen, rejected, nll, beta=0.3)
    torch.testing.assert_close(loss, nll - losses.mean().double(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(metrics["log_odds_ratio"].float(), ratio)
    torch.testing.assert_close(metrics["log_odds_chosen"].float(), log_odds)
    torch.testing.assert_close(metrics["rewards/chosen"].float(), chosen_rewards.mean())


@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
def test_simpo_equals_trl_cpo_with_loss_type_simpo(label_smoothing):
    cpo = pytest.importorskip("trl.experimental.cpo")
    chosen, rejected = case(2)[:2]
    stand_in = types.SimpleNamespace(alpha=0.0, beta=2.5, simpo_gamma=1.2, loss_type="simpo",
                                     label_smoothing=label_smoothing, accelerator=Accelerator())
    losses, chosen_rewards, rejected_rewards = cpo.CPOTrainer.cpo_loss(stand_in, chosen, rejected)
    loss, metrics = simpo_loss(chosen, rejected, beta=2.5, gamma=1.2, label_smoothing=label_smoothing)
    torch.testing.assert_close(loss, losses.mean())  # cpo_alpha=0: no NLL term
    torch.testing.assert_close(metrics["rewards/rejected"], rejected_rewards.mean())


@pytest.mark.parametrize("center", [None, 0.01])
def test_bradley_terry_equals_trl_reward_trainer_compute_loss(center):
    reward = pytest.importorskip("trl.trainer.reward_trainer")
    chosen, rejected = case(3, low=-3.0, high=3.0)[:2]
    scores = torch.cat([chosen, rejected]).unsqueeze(-1)  # (2B, 1): what a sequence classifier returns

    def model(**inputs):
        return types.SimpleNamespace(logits=scores)

    stand_in = types.SimpleNamespace(model=types.SimpleNamespace(training=False), accelerator=Accelerator(),
                                     args=types.SimpleNamespace(center_rewards_coefficient=center),
                                     _metrics=defaultdict(lambda: defaultdict(list)), _total_train_tokens=0)
    trl_loss = reward.RewardTrainer.compute_loss(stand_in, model, {"input_ids": torch.zeros(12, 3)})
    loss, metrics = bradley_terry_loss(chosen, rejected, center_rewards_coefficient=center)
    torch.testing.assert_close(loss, trl_loss)
    assert float(metrics["accuracy"]) == pytest.approx(stand_in._metrics["eval"]["accuracy"][-1])
    assert float(metrics["margin"]) == pytest.approx(stand_in._metrics["eval"]["margin"][-1])


def kto_stand_in(kto_module, loss_type, logps):
    """A KTOTrainer without a trainer: its `_compute_loss` on a model whose summed completion log-probabilities
    are `logps[first token id]` (precomputed reference log-probabilities come in the batch)."""

    def model(input_ids, labels, **kwargs):
        per_token = torch.zeros(input_ids.shape[0], input_ids.shape[1] - 1, dtype=torch.float64)
        per_token[:, 0] = torch.stack([logps[int(i)] for i in input_ids[:, 0]])
        return types.SimpleNamespace(log_probs=per_token, entropy=torch.zeros_like(per_token),
                                     mean_logits=torch.zeros_like(per_token))

    stand_in = types.SimpleNamespace(
        model=types.SimpleNamespace(training=True), accelerator=Accelerator(), loss_type=loss_type, beta=0.4,
        desirable_weight=1.3, undesirable_weight=0.7, calculate_KL=loss_type == "kto", precompute_ref_logps=True,
        aux_loss_enabled=False, _metrics=defaultdict(lambda: defaultdict(list)), _total_train_tokens=0, _tp_size=1)
    stand_in._compute_kl_logps = types.MethodType(kto_module.KTOTrainer._compute_kl_logps, stand_in)
    return stand_in, model


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
def test_kto_equals_trl_kto_trainer_compute_loss(loss_type):
    kto_module = pytest.importorskip("trl.trainer.kto_trainer")
    policy, ref, kl_policy, kl_ref = case(4, n=5)
    kl_ref = kl_ref - 0.5  # a positive mean log-ratio on the mismatched pairs: z0 > 0
    desirable = torch.tensor([True, False, False, True, False])
    logps = {**dict(enumerate(policy)), **{100 + i: v for i, v in enumerate(kl_policy)}}
    stand_in, model = kto_stand_in(kto_module, loss_type, logps)
    ones = torch.ones(5, 4, dtype=torch.long)
    batch = {"input_ids": torch.arange(5).unsqueeze(1) * ones, "attention_mask": ones, "completion_mask": ones,
             "KL_input_ids": (100 + torch.arange(5)).unsqueeze(1) * ones, "KL_attention_mask": ones,
             "KL_completion_mask": ones, "label": desirable, "ref_logps": ref, "ref_KL_logps": kl_ref}
    trl_loss = kto_module.KTOTrainer._compute_loss(stand_in, model, batch, return_outputs=False)
    kl = (kl_policy, kl_ref) if loss_type == "kto" else (None, None)
    loss, metrics = kto_loss(policy, ref, desirable, *kl, beta=0.4, desirable_weight=1.3, undesirable_weight=0.7,
                             loss_type=loss_type)
    torch.testing.assert_close(loss, trl_loss)
    trl_metrics = stand_in._metrics["train"]
    if loss_type == "kto":
        assert float(metrics["kl"]) == pytest.approx(trl_metrics["kl"][-1]) and float(metrics["kl"]) > 0
    for name in ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected", "rewards/margins"):
        assert float(metrics[name]) == pytest.approx(trl_metrics[name][-1], rel=1e-6), name
