"""GRPO's loss at TRL's options: each loss_type by hand and against TRL's own loss on the same tensors,
clip-higher, and the rollout importance weights of every mode."""

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from astrai_pl.model import ConfigError
from astrai_pl.objectives.losses import grpo_loss, rollout_importance_weights

# Two completions of 2 and 1 tokens (the second padded), advantages +1 and −1, ratios exp(logps − old).
LOGPS = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]], dtype=torch.float64)
RATIOS = torch.tensor([[1.5, 0.5], [0.6, 1.0]], dtype=torch.float64)
OLD = LOGPS - RATIOS.log()
ADV = torch.tensor([1.0, -1.0], dtype=torch.float64)
MASK = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=torch.float64)


def hand_tokens(eps_high=0.2):
    """−min(ρA, clip(ρ, 0.8, 1 + eps_high)·A) per token, worked out by hand for RATIOS and ADV."""
    # row 0, A = +1: ρ = 1.5 → min(1.5, 1 + eps_high); ρ = 0.5 → min(0.5, 0.8) = 0.5
    # row 1, A = −1: ρ = 0.6 → −min(−0.6, −0.8) = 0.8
    return [-min(1.5, 1 + eps_high), -0.5, 0.8]


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_each_loss_type_equals_its_hand_computed_value(loss_type):
    a, b, c = hand_tokens()  # −1.2, −0.5, 0.8
    expected = {
        "grpo": ((a + b) / 2 + c / 1) / 2,  # per-sequence means, then their mean
        "bnpo": (a + b + c) / 3,  # over this batch's 3 tokens
        "dr_grpo": (a + b + c) / (2 * 4),  # B · max_completion_length
        "dapo": (a + b + c) / 6,  # over num_items: the whole step's tokens, given
    }[loss_type]
    loss, metrics = grpo_loss(LOGPS, OLD, None, ADV, MASK, epsilon=0.2, beta=0.0, loss_type=loss_type,
                              max_len=4, num_items=6.0)
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert metrics["policy_loss"].item() == pytest.approx(expected, rel=1e-12)


def test_clip_higher_lets_positive_tokens_grow_further_and_counts_each_side():
    low, _ = grpo_loss(LOGPS, OLD, None, ADV, MASK, epsilon=0.2, beta=0.0, loss_type="bnpo")
    high, metrics = grpo_loss(LOGPS, OLD, None, ADV, MASK, epsilon=0.2, beta=0.0, loss_type="bnpo",
                              epsilon_high=0.28)
    assert low.item() == pytest.approx(sum(hand_tokens(0.2)) / 3, rel=1e-12)
    assert high.item() == pytest.approx(sum(hand_tokens(0.28)) / 3, rel=1e-12)
    # ρ = 1.5 with A > 0 is above 1.28 (high); ρ = 0.6 with A < 0 is below 0.8 (low); ρ = 0.5, A > 0 is kept
    assert metrics["clip_ratio/high_mean"].item() == pytest.approx(1 / 3)
    assert metrics["clip_ratio/low_mean"].item() == pytest.approx(1 / 3)
    assert metrics["clip_ratio"].item() == pytest.approx(2 / 3)
    logps = LOGPS.clone().requires_grad_(True)
    grpo_loss(logps, OLD, None, ADV, MASK, epsilon=0.2, beta=0.0, loss_type="bnpo", epsilon_high=2.0)[0].backward()
    assert logps.grad[0, 0] != 0  # with a wide upper band, ρ = 1.5 still has a gradient


def test_importance_weights_multiply_the_policy_term_only():
    ref = LOGPS + 0.3
    w = torch.tensor([[2.0, 0.5], [3.0, 1.0]], dtype=torch.float64)
    plain, m0 = grpo_loss(LOGPS, OLD, ref, ADV, MASK, beta=0.1, loss_type="bnpo")
    weighted, m1 = grpo_loss(LOGPS, OLD, ref, ADV, MASK, beta=0.1, loss_type="bnpo", importance_weights=w)
    a, b, c = hand_tokens()
    assert m1["policy_loss"].item() == pytest.approx((2 * a + 0.5 * b + 3 * c) / 3, rel=1e-12)
    assert (weighted - m1["policy_loss"]).item() == pytest.approx((plain - m0["policy_loss"]).item(), rel=1e-12)


def test_importance_weights_of_every_mode_by_hand():
    train = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    rollout = torch.tensor([[-math.log(4), math.log(2), 0.0], [math.log(8), 0.0, -5.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]], dtype=torch.float64)  # the −5.0 is padding

    def weights(mode, **kw):
        return rollout_importance_weights(train, rollout, mask, mode, **kw)

    # per token w = exp(train − rollout): [4, 1/2, ·], [1/8, 1, ·]; padding gets 1
    torch.testing.assert_close(weights("token_truncate", clip_max=3.0),
                               torch.tensor([[3.0, 0.5, 1.0], [0.125, 1.0, 1.0]], dtype=torch.float64))
    torch.testing.assert_close(weights("token_truncate", clip_max=3.0, clip_min=0.25),
                               torch.tensor([[3.0, 0.5, 1.0], [0.25, 1.0, 1.0]], dtype=torch.float64))
    torch.testing.assert_close(weights("token_mask", clip_max=3.0, clip_min=0.25),
                               torch.tensor([[0.0, 0.5, 1.0], [0.0, 1.0, 1.0]], dtype=torch.float64))
    # per sequence W = exp(Σ train − rollout): 4 · 1/2 = 2 and 1/8
    torch.testing.assert_close(weights("sequence_truncate", clip_max=1.5),
                               torch.tensor([[1.5], [0.125]], dtype=torch.float64))
    torch.testing.assert_close(weights("sequence_mask", clip_max=3.0, clip_min=0.25),
                               torch.tensor([[2.0], [0.0]], dtype=torch.float64))
    torch.testing.assert_close(weights("token_truncate", clip_max=None), train.exp() / rollout.exp() * mask
                               + (1 - mask))


@pytest.mark.parametrize("kwargs, match", [
    ({"mode": "tis"}, "vllm_importance_sampling_mode"),
    ({"clip_max": 0.0}, "vllm_importance_sampling_clip_max"),
    ({"clip_max": 1.0, "clip_min": 2.0}, "vllm_importance_sampling_clip_min=2.0 is above"),
])
def test_bad_importance_sampling_options_name_the_field(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        rollout_importance_weights(LOGPS, LOGPS, MASK, **{"mode": "token_truncate", **kwargs})


def test_the_old_token_loss_type_is_refused_with_its_new_name():
    with pytest.raises(ConfigError, match="loss_type='token' was renamed 'dapo'"):
        grpo_loss(LOGPS, OLD, None, ADV, MASK, beta=0.0, loss_type="token")
    with pytest.raises(ConfigError, match="epsilon_high"):
        grpo_loss(LOGPS, OLD, None, ADV, MASK, beta=0.0, epsilon_high=0.0)


# -- against TRL's GRPOTrainer._compute_loss on the same tensors ---------------------------------------------

def trl_loss(logps, old, ref, adv, mask, weights, *, loss_type, epsilon, epsilon_high, beta, max_len,
             importance_sampling_level="token", sapo_temperature_pos=1.0, sapo_temperature_neg=1.05,
             entropies=None, entropy_coef=0.0, metrics=None):
    """TRL's own loss: GRPOTrainer._compute_loss run on a stand-in trainer (one process, no accumulation)
    whose forward returns `logps` (and `entropies`); TRL's logged metrics land in `metrics` when given."""
    trl = pytest.importorskip("trl")
    one_process = SimpleNamespace(num_processes=1, sync_gradients=True, gather=lambda x: x,
                                  gather_for_metrics=lambda x: x, reduce=lambda x, reduction: x)
    entropies = torch.zeros_like(logps) if entropies is None else entropies
    trainer = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, entropies, None),
        aux_loss_enabled=False, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level=importance_sampling_level, beta=beta, loss_type=loss_type, epsilon_low=epsilon,
        epsilon_high=epsilon_high, use_vllm=weights is not None, vllm_importance_sampling_correction=True,
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1,
                             sapo_temperature_pos=sapo_temperature_pos, sapo_temperature_neg=sapo_temperature_neg),
        model=SimpleNamespace(training=True), current_gradient_accumulation_steps=1, accelerator=one_process,
        max_completion_length=max_len, _entropy_bonus_enabled=entropy_coef != 0.0, entropy_coef=entropy_coef,
        use_adaptive_entropy=False, _metrics={"train": defaultdict(list) if metrics is None else metrics})
    B, T = logps.shape
    inputs = {"prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1),
              "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask,
              "advantages": adv, "old_per_token_logps": old, "ref_per_token_logps": ref,
              "num_items_in_batch": mask.sum(), "importance_sampling_ratio": weights}
    return trl.GRPOTrainer._compute_loss(trainer, None, inputs)


def random_rollout(seed=0, B=4, T=6):
    gen = torch.Generator().manual_seed(seed)
    logps = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3
    old = logps + torch.randn(B, T, generator=gen, dtype=torch.float64) * 0.3  # ratios both sides of the band
    ref = logps + torch.randn(B, T, generator=gen, dtype=torch.float64) * 0.5
    rollout = old + torch.randn(B, T, generator=gen, dtype=torch.float64) * 0.5
    adv = torch.randn(B, generator=gen, dtype=torch.float64)
    mask = torch.zeros(B, T, dtype=torch.float64)
    for b, n in enumerate([6, 2, 4, 1][:B]):
        mask[b, :n] = 1
    return logps, old, ref, rollout, adv, mask


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("correction", [False, True])
def test_loss_and_gradient_equal_trls_on_the_same_tensors(loss_type, correction):
    logps, old, ref, rollout, adv, mask = random_rollout()
    weights = rollout_importance_weights(old, rollout, mask, "token_truncate", 2.0) if correction else None
    options = dict(epsilon=0.2, epsilon_high=0.28, beta=0.04)
    ours_logps = logps.clone().requires_grad_(True)
    ours, _ = grpo_loss(ours_logps, old, ref, adv, mask, loss_type=loss_type, max_len=8, num_items=mask.sum(),
                        importance_weights=weights, **options)
    ours.backward()
    trl_logps = logps.clone().requires_grad_(True)
    theirs = trl_loss(trl_logps, old, ref, adv, mask, weights, loss_type=loss_type, max_len=8, **options)
    theirs.backward()
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-12)
    torch.testing.assert_close(ours_logps.grad, trl_logps.grad, rtol=1e-12, atol=1e-15)


# -- GSPO, cispo, sapo and the entropy bonus against TRL, in the default suite ----------------------------------

VARIANTS = [  # (loss_type, importance_sampling_level, options)
    ("grpo", "sequence", dict(epsilon=0.2, epsilon_high=0.28)),  # GSPO as its paper reduces it
    ("dapo", "sequence", dict(epsilon=0.2, epsilon_high=0.28)),
    ("cispo", "token", dict(epsilon=0.2, epsilon_high=1.1)),  # a cap some ratios pass
    ("cispo", "sequence", dict(epsilon=0.2, epsilon_high=1.05)),
    ("sapo", "token", dict(epsilon=0.2, epsilon_high=None, sapo_temperature_pos=1.3, sapo_temperature_neg=0.9)),
    ("sapo", "sequence", dict(epsilon=0.2, epsilon_high=None)),
]


@pytest.mark.parametrize("loss_type,level,options", VARIANTS, ids=lambda v: v if isinstance(v, str) else "-".join(f"{k}={x}" for k, x in v.items()))
@pytest.mark.parametrize("correction", [False, True])
def test_gspo_cispo_and_sapo_equal_trls_loss_and_gradient(loss_type, level, options, correction):
    logps, old, ref, rollout, adv, mask = random_rollout(seed=7)
    weights = rollout_importance_weights(old, rollout, mask, "token_truncate", 2.0) if correction else None
    ours_logps = logps.clone().requires_grad_(True)
    ours, metrics = grpo_loss(ours_logps, old, ref, adv, mask, beta=0.04, loss_type=loss_type, max_len=8,
                              num_items=mask.sum(), importance_weights=weights, importance_sampling_level=level,
                              **options)
    ours.backward()
    trl_logps = logps.clone().requires_grad_(True)
    logged = defaultdict(list)
    high = options.get("epsilon_high") or options["epsilon"]
    theirs = trl_loss(trl_logps, old, ref, adv, mask, weights, loss_type=loss_type, beta=0.04, max_len=8,
                      importance_sampling_level=level, metrics=logged, **{**options, "epsilon_high": high})
    theirs.backward()
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-12)
    assert ours_logps.grad.abs().sum() > 0
    torch.testing.assert_close(ours_logps.grad, trl_logps.grad, rtol=1e-12, atol=1e-15)
    names = {"clip_ratio": "clip_ratio/region_mean", "clip_ratio/low_mean": "clip_ratio/low_mean",
             "clip_ratio/high_mean": "clip_ratio/high_mean", "cispo_clip_ratio": "cispo_clip_ratio"}
    for ours_name, trl_name in names.items():
        assert (ours_name in metrics) == (trl_name in logged), ours_name
        if ours_name in metrics:
            assert float(metrics[ours_name]) == pytest.approx(logged[trl_name][-1], abs=1e-7), ours_name


def test_gspo_ratio_is_the_length_normalised_sequence_ratio():
    logps, old, _, _, adv, mask = random_rollout(seed=8)
    loss, _ = grpo_loss(logps, old, None, adv, mask, epsilon=10.0, beta=0.0, loss_type="grpo",
                        importance_sampling_level="sequence")  # a band no ratio leaves: the unclipped surrogate
    seq_ratio = torch.exp(((logps - old) * mask).sum(1) / mask.sum(1))  # (B,)
    assert loss.item() == pytest.approx(-(seq_ratio * adv).mean().item(), rel=1e-12)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_entropy_bonus_equals_trls(loss_type):
    logps, old, ref, _, adv, mask = random_rollout(seed=9)
    entropies = torch.rand(logps.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 2
    ours_logps, ours_h = logps.clone().requires_grad_(True), entropies.clone().requires_grad_(True)
    ours, metrics = grpo_loss(ours_logps, old, ref, adv, mask, epsilon=0.2, beta=0.04, loss_type=loss_type,
                              num_items=mask.sum(), entropies=ours_h, entropy_coef=0.03)
    ours.backward()
    trl_logps, trl_h = logps.clone().requires_grad_(True), entropies.clone().requires_grad_(True)
    logged = defaultdict(list)
    theirs = trl_loss(trl_logps, old, ref, adv, mask, None, loss_type=loss_type, epsilon=0.2, epsilon_high=0.2,
                      beta=0.04, max_len=None, entropies=trl_h, entropy_coef=0.03, metrics=logged)
    theirs.backward()
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-12)
    torch.testing.assert_close(ours_logps.grad, trl_logps.grad, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(ours_h.grad, trl_h.grad, rtol=1e-12, atol=1e-15)
    assert float(metrics["entropy"]) == pytest.approx(logged["entropy"][-1], rel=1e-12)


@pytest.mark.parametrize("kwargs,match", [
    ({"loss_type": "cispo"}, "epsilon_high"),
    ({"importance_sampling_level": "tokens"}, "importance_sampling_level"),
    ({"loss_type": "sapo", "sapo_temperature_neg": 0.0}, "sapo_temperature_neg"),
    ({"entropy_coef": 0.1}, "entropies"),
    ({"entropy_coef": -0.1}, "entropy_coef"),
])
def test_new_grpo_options_refuse_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        grpo_loss(LOGPS, OLD, None, ADV, MASK, beta=0.0, **kwargs)
