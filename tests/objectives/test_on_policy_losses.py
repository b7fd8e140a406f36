"""GKD's generalised JSD, RLOO's advantages and loss, and Online DPO's pairs: against TRL's own code on the
same tensors, and against their definitions."""

import types
from collections import defaultdict

import pytest
import torch
import torch.nn.functional as F

from astrai_pl.model.config import ConfigError
from astrai_pl.objectives.losses import dpo_loss
from astrai_pl.objectives.on_policy_losses import (
    generalized_jsd_loss,
    kl_penalised_rewards,
    preference_pairs,
    rloo_advantages,
    rloo_loss,
    topk_generalized_jsd_loss,
)


def logits_case(seed=0, B=3, T=5, V=11):
    gen = torch.Generator().manual_seed(seed)
    student = torch.randn(B, T, V, generator=gen, dtype=torch.float64) * 2
    teacher = torch.randn(B, T, V, generator=gen, dtype=torch.float64) * 2
    labels = torch.randint(0, V, (B, T), generator=gen)
    labels[0, :2] = -100  # a prompt
    labels[2, 3:] = -100  # padding
    return student, teacher, labels


@pytest.mark.parametrize("beta", [0.0, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_generalized_jsd_loss_and_gradient_equal_trls(beta, temperature):
    gkd = pytest.importorskip("trl.experimental.gkd")
    student, teacher, labels = logits_case()
    ours_in, theirs_in = student.clone().requires_grad_(True), student.clone().requires_grad_(True)
    ours, metrics = generalized_jsd_loss(ours_in, teacher, labels, beta=beta, temperature=temperature)
    theirs = gkd.GKDTrainer.generalized_jsd_loss(theirs_in, teacher, labels, beta=beta, temperature=temperature)
    ours.backward()
    theirs.backward()
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-12) and ours.item() > 0
    torch.testing.assert_close(ours_in.grad, theirs_in.grad, rtol=1e-10, atol=1e-14)
    assert metrics["tokens"].item() == (labels != -100).sum().item()


def test_num_items_divides_the_sum_as_trls_does():
    gkd = pytest.importorskip("trl.experimental.gkd")
    student, teacher, labels = logits_case(1)
    ours, _ = generalized_jsd_loss(student, teacher, labels, beta=0.3, num_items=40)
    theirs = gkd.GKDTrainer.generalized_jsd_loss(student, teacher, labels, beta=0.3, num_items_in_batch=40)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-12)


def test_equal_distributions_have_zero_divergence_and_no_gradient():
    student, _, labels = logits_case()
    for beta in (0.0, 0.5, 1.0):
        x = student.clone().requires_grad_(True)
        loss, _ = generalized_jsd_loss(x, student, labels, beta=beta)
        loss.backward()
        assert abs(loss.item()) < 1e-12 and x.grad.abs().max() < 1e-12


def test_topk_over_the_whole_vocabulary_is_the_full_divergence():
    student, teacher, labels = logits_case(2)
    keep = labels != -100
    s, t = student[keep], teacher[keep]  # (N, V)
    ids = t.argsort(-1, descending=True)  # all V ids, best first
    logps = F.log_softmax(t, -1).gather(-1, ids)
    for beta, temperature in ((0.5, 1.0), (0.0, 0.8), (1.0, 1.3)):
        full, _ = generalized_jsd_loss(s, t, beta=beta, temperature=temperature)
        top, _ = topk_generalized_jsd_loss(s, ids, logps, beta=beta, temperature=temperature)
        assert top.item() == pytest.approx(full.item(), rel=1e-10)


def test_topk_is_the_divergence_of_both_distributions_renormalised_on_the_teachers_k_ids():
    gkd = pytest.importorskip("trl.experimental.gkd")
    student, teacher, labels = logits_case(3, V=17)
    keep = labels != -100
    s, t = student[keep], teacher[keep]
    ids = t.topk(4, -1).indices  # (N, 4)
    logps = F.log_softmax(t, -1).gather(-1, ids)  # what a server reports: log-probs over the whole vocabulary
    ids[0, 3], logps[0, 3] = ids[0, 0], float("-inf")  # a row with only 3 alternatives, padded
    ours, _ = topk_generalized_jsd_loss(s, ids, logps, beta=0.4, temperature=0.9)
    restricted_t = t.gather(-1, ids).masked_fill(torch.isinf(logps), float("-inf"))
    restricted_s = s.gather(-1, ids).masked_fill(torch.isinf(logps), float("-inf"))
    jsd = gkd.GKDTrainer.generalized_jsd_loss(restricted_s[1:], restricted_t[1:], beta=0.4, temperature=0.9,
                                              reduction="sum")
    row0, _ = generalized_jsd_loss(s.gather(-1, ids[:1, :3]), t.gather(-1, ids[:1, :3]), beta=0.4, temperature=0.9)
    assert ours.item() == pytest.approx((jsd.item() + row0.item()) / len(s), rel=1e-10)


def test_bad_beta_is_a_config_error_naming_it():
    student, teacher, labels = logits_case()
    with pytest.raises(ConfigError, match="Distill.beta=1.5"):
        generalized_jsd_loss(student, teacher, labels, beta=1.5)


# -- RLOO ----------------------------------------------------------------------------------------------------
def test_leave_one_out_baseline_is_the_mean_of_the_siblings():
    rewards = torch.tensor([1.0, 0.0, 3.0, 2.0, 5.0, 5.0, -1.0, 1.0], dtype=torch.float64)
    G = 4
    expected = torch.tensor([r - (sum(rewards[g * G:(g + 1) * G]) - r) / (G - 1)
                             for g in range(2) for r in rewards[g * G:(g + 1) * G]], dtype=torch.float64)
    torch.testing.assert_close(rloo_advantages(rewards, G), expected)
    # equal to G/(G−1)·(r − group mean)
    grouped = rewards.view(2, G)
    torch.testing.assert_close(rloo_advantages(rewards, G), (G / (G - 1) * (grouped - grouped.mean(1, True))).view(-1))


def test_unscorable_completions_leave_the_baseline_and_get_no_advantage():
    rewards = torch.tensor([1.0, float("nan"), 4.0, float("nan"), float("nan"), 2.0])
    advantages = rloo_advantages(rewards, 3)
    torch.testing.assert_close(advantages, torch.tensor([-3.0, 0.0, 3.0, 0.0, 0.0, 0.0]))


def test_kl_in_the_reward_is_the_summed_first_order_estimate():
    rewards = torch.tensor([1.0, 2.0])
    old = torch.tensor([[-1.0, -2.0, -9.0], [-0.5, -0.5, -0.5]])
    ref = torch.tensor([[-1.5, -1.0, 0.0], [-0.5, -1.5, -0.5]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    penalised, kl = kl_penalised_rewards(rewards, old, ref, mask, beta=0.1)
    torch.testing.assert_close(kl, torch.tensor([0.5 - 1.0, 1.0]))
    torch.testing.assert_close(penalised, torch.tensor([1.0 + 0.05, 2.0 - 0.1]))


def trl_rloo_loss(logps, old_seq, advantages, mask, epsilon, epsilon_high):
    """TRL's own loss: RLOOTrainer._compute_loss on a stand-in trainer whose forward returns `logps`."""
    rloo = pytest.importorskip("trl.trainer.rloo_trainer")
    one_process = types.SimpleNamespace(gather=lambda x: x, reduce=lambda x, reduction: x)
    stand_in = types.SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, torch.zeros_like(logps), None),
        aux_loss_enabled=False, epsilon_low=epsilon, epsilon_high=epsilon_high, accelerator=one_process,
        model=types.SimpleNamespace(training=True), _metrics={"train": defaultdict(list)})
    B, T = logps.shape
    inputs = {"prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1),
              "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask,
              "old_logps": old_seq, "advantages": advantages}
    return rloo.RLOOTrainer._compute_loss(stand_in, None, inputs), stand_in._metrics["train"]


def test_rloo_loss_and_gradient_equal_trls():
    gen = torch.Generator().manual_seed(0)
    B, T = 6, 5
    logps = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 2
    mask = (torch.arange(T)[None] < torch.tensor([5, 3, 1, 4, 5, 2])[:, None]).double()
    old_tokens = logps + torch.randn(B, T, generator=gen, dtype=torch.float64) * 0.2  # ratios both sides of the band
    advantages = torch.randn(B, generator=gen, dtype=torch.float64)
    ours_in, theirs_in = logps.clone().requires_grad_(True), logps.clone().requires_grad_(True)
    ours, metrics = rloo_loss(ours_in, old_tokens, advantages, mask, epsilon=0.2, epsilon_high=0.28)
    theirs, trl_metrics = trl_rloo_loss(theirs_in, (old_tokens * mask).sum(-1), advantages, mask, 0.2, 0.28)
    ours.backward()
    theirs.backward()
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-12)
    torch.testing.assert_close(ours_in.grad, theirs_in.grad, rtol=1e-12, atol=1e-15)
    assert 0 < metrics["clip_ratio/region_mean"].item() < 1
    for name in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
        assert metrics[name].item() == pytest.approx(trl_metrics[name][-1]), name


def test_first_pass_rloo_is_reinforce_with_the_baseline():
    logps = torch.tensor([[-1.0, -2.0], [-0.5, -0.1]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    advantages = torch.tensor([2.0, -1.0])
    loss, _ = rloo_loss(logps, None, advantages, mask)
    loss.backward()
    torch.testing.assert_close(loss, torch.tensor(-0.5))  # −mean A at ρ = 1
    torch.testing.assert_close(logps.grad, -advantages[:, None] * mask / 2)


# -- Online DPO ----------------------------------------------------------------------------------------------
def test_pairs_choose_the_higher_reward_and_the_first_on_a_tie():
    chosen, rejected = preference_pairs(torch.tensor([0.1, 0.9, 2.0, 1.0, 3.0, 3.0, float("nan"), 0.0]))
    assert chosen.tolist() == [1, 2, 4, 7] and rejected.tolist() == [0, 3, 5, 6]


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_online_dpo_loss_and_gradient_equal_trls_training_step(loss_type):
    """TRL's OnlineDPOTrainer.training_step on a stand-in whose sampler, forward and reward are given tensors:
    its loss and the policy's gradients are ours (`preference_pairs` + `dpo_loss` on summed log-probs)."""
    online = pytest.importorskip("trl.experimental.online_dpo.online_dpo_trainer")
    gen = torch.Generator().manual_seed(4)
    P, T = 3, 4
    # TRL orders its 2P samples as [first of each prompt, second of each prompt]; ours are grouped by prompt
    logps = -torch.rand(2 * P, T, generator=gen, dtype=torch.float64) * 2
    ref = logps.detach() + torch.randn(2 * P, T, generator=gen, dtype=torch.float64) * 0.3
    mask = (torch.arange(T)[None] < torch.tensor([4, 2, 3, 1, 4, 3])[:, None]).long()
    rewards = torch.tensor([0.5, 1.0, 2.0, 0.7, 1.0, -1.0], dtype=torch.float64)
    theirs_in = logps.clone().requires_grad_(True)
    stand_in = online_stand_in(online, theirs_in, ref, mask, rewards, loss_type)
    theirs = online.OnlineDPOTrainer.training_step(stand_in, stand_in.model, {"prompt": ["a", "b", "c"]})

    order = torch.tensor([0, 3, 1, 4, 2, 5])  # TRL's index of our (prompt, sample) → grouped by prompt
    ours_in = logps[order].clone().requires_grad_(True)
    sums, ref_sums = (ours_in * mask[order]).sum(-1), (ref[order] * mask[order]).sum(-1)
    chosen, rejected = preference_pairs(rewards[order])
    ours, _ = dpo_loss(sums[chosen], sums[rejected], ref_sums[chosen], ref_sums[rejected], beta=0.3,
                       loss_type=loss_type)
    ours.backward()
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-12)
    torch.testing.assert_close(ours_in.grad, theirs_in.grad[order], rtol=1e-12, atol=1e-15)


def online_stand_in(online, logps, ref, mask, rewards, loss_type):
    P2, T = logps.shape
    accelerator = types.SimpleNamespace(gather_for_metrics=lambda x: x, backward=lambda loss, **k: loss.backward())
    return types.SimpleNamespace(
        model=torch.nn.Linear(1, 1), ref_model=object(), beta=0.3, eos_token_ids=[2], reward_funcs=[None],
        args=types.SimpleNamespace(use_vllm=False, missing_eos_penalty=None, loss_type=loss_type,
                                   torch_empty_cache_steps=None, optim="adamw_torch", n_gpu=1,
                                   gradient_accumulation_steps=1),
        _generate=lambda model, prompts, images: (torch.zeros(P2, 1, dtype=torch.long), torch.ones(P2, 1),
                                                  torch.ones(P2, T, dtype=torch.long), mask, None),
        _forward=lambda model, *a: logps if isinstance(model, torch.nn.Module) else ref,
        processing_class=types.SimpleNamespace(batch_decode=lambda ids, **k: ["x"] * len(ids)),
        _calculate_rewards_from_functions=lambda **k: rewards.clone(),
        stats=defaultdict(list), accelerator=accelerator, state=types.SimpleNamespace(global_step=0))
