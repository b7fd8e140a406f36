"""The pure losses against direct formulas, torch references and hand-computed values."""

import math

import pytest
import torch
import torch.nn.functional as F

from astrai_pl.model import ModelConfig, Transformer
from astrai_pl.objectives.losses import (
    IGNORE_INDEX,
    cross_entropy,
    dpo_loss,
    group_advantages,
    grpo_loss,
    linear_cross_entropy,
    logprobs_from_logits,
    next_token_labels,
    sequence_logprobs,
    token_logprobs,
)

# -- cross-entropy ------------------------------------------------------------------------------------


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cross_entropy_equals_torch_mean_over_trained_tokens(smoothing):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 6, 11, generator=gen)
    labels = torch.randint(0, 11, (2, 6), generator=gen)
    labels[0, :2] = IGNORE_INDEX
    loss, metrics = cross_entropy(logits, labels, label_smoothing=smoothing)
    expected = F.cross_entropy(logits.view(-1, 11), labels.view(-1), label_smoothing=smoothing)
    torch.testing.assert_close(loss, expected)
    nll = F.cross_entropy(logits.view(-1, 11), labels.view(-1))
    torch.testing.assert_close(metrics["nll"], nll)
    assert metrics["tokens"] == 10


def lm_head_case(dtype=torch.float64, rows=(2, 9), hidden=16, vocab=37, seed=0):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(*rows, hidden, generator=gen, dtype=dtype).requires_grad_(True)
    w = (3 * torch.randn(vocab, hidden, generator=gen, dtype=dtype)).requires_grad_(True)
    labels = torch.randint(0, vocab, rows, generator=gen)
    labels[0, :4] = IGNORE_INDEX  # a prompt
    labels[1, -2:] = IGNORE_INDEX  # padding
    return h, w, labels


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("chunk_size", [1, 4, 256])
def test_linear_cross_entropy_equals_cross_entropy_of_the_logits_with_gradients(smoothing, chunk_size):
    h, w, labels = lm_head_case()
    normalizer = torch.tensor(7.0, dtype=torch.float64)  # an accumulation window's token count
    expected, expected_metrics = cross_entropy(h @ w.t(), labels, label_smoothing=smoothing, normalizer=normalizer)
    grads = torch.autograd.grad(3 * expected, (h, w))
    loss, metrics = linear_cross_entropy(h, w, labels, label_smoothing=smoothing, normalizer=normalizer,
                                         chunk_size=chunk_size)
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(metrics["nll"], expected_metrics["nll"])
    assert metrics["tokens"] == expected_metrics["tokens"] == 12
    for got, want in zip(torch.autograd.grad(3 * loss, (h, w)), grads):
        torch.testing.assert_close(got, want)


def test_linear_cross_entropy_gives_untrained_positions_no_gradient_and_needs_no_graph():
    h, w, labels = lm_head_case()
    loss, _ = linear_cross_entropy(h, w, labels)
    loss.backward()
    untrained = labels == IGNORE_INDEX
    assert (h.grad[untrained] == 0).all() and (h.grad[~untrained] != 0).all()
    with torch.no_grad():  # validation: the same value, and no gradient work
        torch.testing.assert_close(linear_cross_entropy(h, w, labels)[0], loss.detach())
    h.grad = w.grad = None
    loss, metrics = linear_cross_entropy(h, w, torch.full_like(labels, IGNORE_INDEX))
    loss.backward()
    assert loss.item() == 0 and metrics["tokens"] == 0
    assert (h.grad == 0).all() and (w.grad == 0).all()


def test_linear_cross_entropy_under_bf16_autocast_matches_the_autocast_lm_head():
    h, w, labels = lm_head_case(dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = cross_entropy(F.linear(h, w), labels)[0]
        loss = linear_cross_entropy(h, w, labels)[0]
    grads = torch.autograd.grad(expected, (h, w))
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, expected, rtol=1e-4, atol=1e-4)  # bf16 products, float32 sums
    for got, want in zip(torch.autograd.grad(loss, (h, w)), grads):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-3)


def test_linear_cross_entropy_refuses_a_second_backward_and_bad_chunks():
    h, w, labels = lm_head_case()
    loss, _ = linear_cross_entropy(h, w, labels)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph"):
        loss.backward()
    with pytest.raises(ValueError, match="chunk_size"):
        linear_cross_entropy(h, w, labels, chunk_size=0)


# -- per-token log-probabilities ----------------------------------------------------------------------


def float64_model(**overrides) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_name("debug", **overrides)).double()
    with torch.no_grad():  # spread the logits so the log-probs are not all ~ −log V
        model.lm_head.weight.mul_(20)
    return model


def prompt_masked(input_ids: torch.Tensor, prompt_len: int) -> torch.Tensor:
    labels = input_ids.clone()
    labels[:, :prompt_len] = IGNORE_INDEX
    labels[1, -3:] = IGNORE_INDEX  # right padding on the second row
    return labels


def direct_logprobs(model, input_ids, labels, temperature=1.0, **kwargs) -> torch.Tensor:
    logp = torch.log_softmax(model(input_ids, **kwargs).logits / temperature, dim=-1)  # (B, T, V)
    targets = next_token_labels(labels)
    picked = logp.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return torch.where(targets != IGNORE_INDEX, picked, 0.0)


def test_logprobs_from_logits_is_a_log_softmax_gather():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, 9, generator=gen, dtype=torch.bfloat16)
    targets = torch.randint(0, 9, (3, 4), generator=gen)
    targets[0, 0] = IGNORE_INDEX
    got = logprobs_from_logits(logits, targets)
    assert got.dtype == torch.float32
    want = torch.log_softmax(logits.float(), -1).gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1)
    want[0, 0] = 0.0
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("chunk_size", [1, 3, 7, 1024])
def test_token_logprobs_equal_a_full_log_softmax_and_so_do_gradients(chunk_size):
    model = float64_model()
    input_ids = torch.randint(3, 320, (2, 12), generator=torch.Generator().manual_seed(1))
    labels = prompt_masked(input_ids, prompt_len=4)
    weights = torch.randn(2, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(2))

    want = direct_logprobs(model, input_ids, labels)
    (want * weights).sum().backward()
    want_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    got = token_logprobs(model, input_ids, labels, chunk_size=chunk_size)
    assert got.shape == (2, 12) and got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    assert (got[:, :3] == 0).all() and (got[:, -1] == 0).all() and (got[1, -4:] == 0).all()
    assert (got[0, 3:-1] < 0).all()
    (got * weights).sum().backward()
    for p, g in zip(model.parameters(), want_grads):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=1e-10)


def test_token_logprobs_runs_the_lm_head_on_chunks_of_scored_positions_only():
    model = float64_model(vocab_size=4096)
    input_ids = torch.randint(3, 4096, (3, 16), generator=torch.Generator().manual_seed(3))
    labels = prompt_masked(input_ids, prompt_len=5)
    rows, kept = [], []

    def keep(t):
        kept.append(tuple(t.shape))
        return t

    hook = model.lm_head.register_forward_hook(lambda mod, args, out: rows.append(out.shape[:-1].numel()))
    try:
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            got = token_logprobs(model, input_ids, labels, chunk_size=4)
        got.sum().backward()  # the backward recomputes each chunk, again at most 4 rows
    finally:
        hook.remove()
    scored = int((next_token_labels(labels) != IGNORE_INDEX).sum())
    assert max(rows) <= 4
    logits_like = [shape for shape in kept if shape[-1] == 4096 and shape != (64, 4096)]  # (64, V): lm_head.T
    assert not logits_like  # no chunk's logits are kept for the backward pass
    assert sum(rows) == 2 * scored  # forward + recomputation; unscored positions never reach the head
    with torch.no_grad():
        torch.testing.assert_close(got, direct_logprobs(model, input_ids, labels), rtol=0, atol=1e-10)
        torch.testing.assert_close(got, token_logprobs(model, input_ids, labels, chunk_size=10_000),
                                   rtol=0, atol=1e-10)


def test_token_logprobs_on_packed_rows_and_with_temperature():
    model = float64_model()
    input_ids = torch.randint(3, 320, (1, 10), generator=torch.Generator().manual_seed(4))
    labels = input_ids.clone()
    labels[0, 5] = IGNORE_INDEX  # the first token of the second document is not predicted from the first
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4]])
    with torch.no_grad():
        got = token_logprobs(model, input_ids, labels, position_ids=position_ids, chunk_size=3, temperature=0.7)
        want = direct_logprobs(model, input_ids, labels, temperature=0.7, position_ids=position_ids)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    assert got[0, 4] == 0


def test_token_logprobs_with_nothing_to_score_is_zero_and_still_differentiable():
    model = float64_model()
    input_ids = torch.randint(3, 320, (2, 6), generator=torch.Generator().manual_seed(5))
    got = token_logprobs(model, input_ids, torch.full_like(input_ids, IGNORE_INDEX))
    assert (got == 0).all()
    got.sum().backward()
    assert all(p.grad is None or (p.grad == 0).all() for p in model.parameters())


def test_sequence_logprobs_sums_over_the_mask():
    token_lp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, 0.0, 0.0]])
    torch.testing.assert_close(sequence_logprobs(token_lp), torch.tensor([-6.0, -0.5]))
    torch.testing.assert_close(sequence_logprobs(token_lp, torch.tensor([[0, 1, 1], [1, 0, 0]])),
                               torch.tensor([-5.0, -0.5]))


# -- DPO ----------------------------------------------------------------------------------------------


def random_logps(n=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [-(torch.rand(n, generator=gen, dtype=torch.float64) * 40 + 5) for _ in range(4)]


@pytest.mark.parametrize("beta", [0.1, 0.5, 2.0])
def test_dpo_is_log_2_when_policy_equals_reference(beta):
    chosen, rejected, _, _ = random_logps()
    loss, metrics = dpo_loss(chosen, rejected, chosen.clone(), rejected.clone(), beta=beta)
    assert loss.item() == pytest.approx(math.log(2), abs=1e-12)
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
        assert metrics[name].item() == 0.0


def direct_dpo(pc, pr, rc, rr, beta, loss_type, eps):
    out = []
    for i in range(len(pc)):
        h = (pc[i].item() - pr[i].item()) - (rc[i].item() - rr[i].item())
        nls = lambda x: math.log1p(math.exp(-x))  # noqa: E731  −log σ(x)
        if loss_type == "sigmoid":
            out.append((1 - eps) * nls(beta * h) + eps * nls(-beta * h))
        elif loss_type == "robust":
            out.append(((1 - eps) * nls(beta * h) - eps * nls(-beta * h)) / (1 - 2 * eps))
        elif loss_type == "ipo":
            out.append((h - 1 / (2 * beta)) ** 2)
        else:
            out.append(max(0.0, 1 - beta * h))
    return sum(out) / len(out)


@pytest.mark.parametrize("loss_type,eps", [("sigmoid", 0.0), ("sigmoid", 0.2), ("robust", 0.0), ("robust", 0.1),
                                           ("ipo", 0.0), ("hinge", 0.0)])
def test_dpo_variants_equal_their_formulas(loss_type, eps):
    logps = random_logps(seed=1)
    loss, _ = dpo_loss(*logps, beta=0.3, loss_type=loss_type, label_smoothing=eps)
    assert loss.item() == pytest.approx(direct_dpo(*logps, 0.3, loss_type, eps), rel=1e-12, abs=1e-12)


def test_dpo_label_smoothing_mixes_the_flipped_pair():
    pc, pr, rc, rr = random_logps(seed=2)
    eps = 0.25
    smoothed, _ = dpo_loss(pc, pr, rc, rr, label_smoothing=eps)
    plain, _ = dpo_loss(pc, pr, rc, rr)
    flipped, _ = dpo_loss(pr, pc, rr, rc)
    assert smoothed.item() == pytest.approx(((1 - eps) * plain + eps * flipped).item(), rel=1e-12)


def test_dpo_metrics_and_gradients():
    pc = torch.tensor([-10.0, -20.0], requires_grad=True)
    pr = torch.tensor([-12.0, -15.0], requires_grad=True)
    rc = torch.tensor([-11.0, -19.0], requires_grad=True)
    rr = torch.tensor([-11.0, -16.0], requires_grad=True)
    loss, m = dpo_loss(pc, pr, rc, rr, beta=0.5)
    # rewards: chosen 0.5·[1, −1], rejected 0.5·[−1, 1]
    expected = {"rewards/chosen": 0.0, "rewards/rejected": 0.0, "rewards/margins": 0.0,
                "rewards/accuracies": 0.5, "logps/chosen": -15.0, "logps/rejected": -13.5}
    assert {k: v.item() for k, v in m.items()} == pytest.approx(expected)
    assert not any(v.requires_grad for v in m.values())
    loss.backward()
    assert pc.grad is not None and pr.grad is not None
    assert rc.grad is None and rr.grad is None
    # d/dπc of mean −log σ(β h) = −β σ(−β h) / B, with h = [2, −2]
    torch.testing.assert_close(pc.grad, -0.5 * torch.sigmoid(-0.5 * torch.tensor([2.0, -2.0])) / 2)


@pytest.mark.parametrize("kwargs,match", [({"loss_type": "kto"}, "loss_type"), ({"beta": 0.0}, "beta"),
                                          ({"beta": -1.0}, "beta"), ({"label_smoothing": 0.5}, "label_smoothing"),
                                          ({"loss_type": "ipo", "label_smoothing": 0.1}, "label_smoothing")])
def test_dpo_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        dpo_loss(*random_logps(), **kwargs)


def test_dpo_names_the_allowed_loss_types():
    with pytest.raises(ValueError, match="sigmoid.*ipo.*hinge"):
        dpo_loss(*random_logps(), loss_type="nope")


# -- group advantages ---------------------------------------------------------------------------------


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_equal_rewards_in_a_group_give_zero_advantage(scale):
    rewards = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    adv = group_advantages(rewards, group_size=4, scale=scale)
    assert (adv[:4] == 0).all()
    assert (adv[4:] != 0).all()


def test_group_advantages_use_each_groups_mean_and_population_std():
    rewards = torch.randn(12, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    groups = rewards.view(3, 4)
    centred = groups - groups.mean(1, keepdim=True)
    group = group_advantages(rewards, 4, eps=1e-8)
    torch.testing.assert_close(group, (centred / (torch.std(groups, 1, unbiased=False, keepdim=True) + 1e-8)).view(-1))
    batch = group_advantages(rewards, 4, eps=1e-8, scale="batch")
    torch.testing.assert_close(batch, centred.view(-1) / (torch.std(rewards, unbiased=False) + 1e-8))
    torch.testing.assert_close(group_advantages(rewards, 4, scale="none"), centred.view(-1))
    assert group.view(3, 4).std(1, unbiased=False).sub(1).abs().max() < 1e-6


def test_group_advantages_hand_computed():
    adv = group_advantages(torch.tensor([1.0, 0.0, 3.0, 1.0]), group_size=2, eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0, 1.0, -1.0]))  # population std of {0, 1} is 0.5


@pytest.mark.parametrize("n,group_size,scale,match", [(6, 4, "group", "divisible"), (4, 1, "group", "num_generations"),
                                                      (4, 2, "global", "scale")])
def test_group_advantages_reject_bad_arguments(n, group_size, scale, match):
    with pytest.raises(ValueError, match=match):
        group_advantages(torch.zeros(n), group_size, scale=scale)


# -- GRPO ---------------------------------------------------------------------------------------------


def rollout(B=4, T=7, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logps = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3
    old = logps + torch.randn(B, T, generator=gen, dtype=torch.float64) * 0.3  # ratios both sides of the band
    ref = logps + torch.randn(B, T, generator=gen, dtype=torch.float64) * 0.5
    adv = torch.randn(B, generator=gen, dtype=torch.float64)
    mask = torch.zeros(B, T, dtype=torch.float64)
    for b, n in enumerate([7, 3, 5, 1][:B]):
        mask[b, :n] = 1
    return logps, old, ref, adv, mask


def direct_grpo(logps, old, ref, adv, mask, eps, beta, loss_type):
    B, T = logps.shape
    per_seq, total, count = [], 0.0, 0.0
    for b in range(B):
        seq = 0.0
        for t in range(T):
            if not mask[b, t]:
                continue
            rho = math.exp(logps[b, t] - old[b, t])
            a = adv[b].item()
            pg = -min(rho * a, min(max(rho, 1 - eps), 1 + eps) * a)
            r = math.exp(ref[b, t] - logps[b, t])
            seq += pg + beta * (r - math.log(r) - 1)
        per_seq.append(seq / max(mask[b].sum().item(), 1))
        total += seq
        count += mask[b].sum().item()
    if loss_type in ("dapo", "bnpo"):
        return total / count
    if loss_type == "grpo":
        return sum(per_seq) / B
    return total / (B * T)


@pytest.mark.parametrize("loss_type", ["dapo", "bnpo", "grpo", "dr_grpo"])
def test_grpo_equals_its_formula(loss_type):
    logps, old, ref, adv, mask = rollout()
    loss, metrics = grpo_loss(logps, old, ref, adv, mask, epsilon=0.2, beta=0.05, loss_type=loss_type)
    assert loss.item() == pytest.approx(direct_grpo(logps, old, ref, adv, mask, 0.2, 0.05, loss_type), rel=1e-12)
    no_kl = direct_grpo(logps, old, ref, adv, mask, 0.2, 0.0, loss_type)
    assert metrics["policy_loss"].item() == pytest.approx(no_kl, rel=1e-12)
    assert metrics["kl"].item() == pytest.approx(direct_grpo(logps, logps, ref, adv * 0, mask, 0.2, 1.0, "dapo"))


def test_dr_grpo_divides_by_the_given_max_len():
    logps, old, ref, adv, mask = rollout()
    at_t, _ = grpo_loss(logps, old, ref, adv, mask, loss_type="dr_grpo")
    at_14, _ = grpo_loss(logps, old, ref, adv, mask, loss_type="dr_grpo", max_len=14)
    assert at_14.item() == pytest.approx(at_t.item() / 2, rel=1e-12)


def test_first_pass_on_policy_has_unit_ratio_and_zero_kl():
    logps, _, _, adv, mask = rollout()
    for old in (logps.clone(), None):
        loss, m = grpo_loss(logps, old, logps.clone(), adv, mask, beta=0.1)
        assert m["kl"].item() == 0.0 and m["clip_ratio"].item() == 0.0
        expected = -(adv[:, None] * mask).sum() / mask.sum()  # ρ = 1: −A per token, token-averaged
        torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)


def test_equal_group_rewards_make_the_policy_gradient_vanish():
    logps, old, ref, _, mask = rollout()
    adv = group_advantages(torch.tensor([0.5, 0.5, 0.5, 0.5]), group_size=4)
    assert (adv == 0).all()
    logps.requires_grad_(True)
    loss, _ = grpo_loss(logps, old, ref, adv, mask, beta=0.0)
    loss.backward()
    assert (logps.grad == 0).all()
    logps.grad = None
    with_kl, _ = grpo_loss(logps, old, ref, adv, mask, beta=0.1)
    with_kl.backward()
    log_r = ref - logps.detach()
    torch.testing.assert_close(logps.grad, 0.1 * (1 - torch.exp(log_r)) * mask / mask.sum())  # the KL term's only


def test_gradients_reach_the_current_log_probs_only():
    logps, old, ref, adv, mask = (t.clone().requires_grad_(True) for t in rollout())
    loss, metrics = grpo_loss(logps, old, ref, adv, mask)
    loss.backward()
    assert logps.grad is not None and logps.grad.abs().sum() > 0
    assert old.grad is None and ref.grad is None and adv.grad is None
    assert not any(v.requires_grad for v in metrics.values())


def test_clip_ratio_counts_tokens_whose_clipped_branch_wins():
    old = torch.zeros(2, 3)
    ratios = torch.tensor([[0.5, 1.0, 1.5], [0.5, 1.0, 1.5]])
    adv = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    _, m = grpo_loss(ratios.log(), old, None, adv, mask, epsilon=0.2, beta=0.0)
    # clipped: ρ = 1.5 with A > 0 (row 0) and ρ = 0.5 with A < 0 (row 1); the ρ = 1.5, A < 0 token is masked
    assert m["clip_ratio"].item() == pytest.approx(2 / 5)
    assert m["kl"].item() == 0.0


def test_grpo_rejects_bad_arguments():
    logps, old, ref, adv, mask = rollout()
    with pytest.raises(ValueError, match="ref_logps"):
        grpo_loss(logps, old, None, adv, mask, beta=0.01)
    with pytest.raises(ValueError, match="loss_type.*grpo.*bnpo.*dr_grpo.*dapo"):
        grpo_loss(logps, old, ref, adv, mask, loss_type="seq")
    with pytest.raises(ValueError, match="advantages"):
        grpo_loss(logps, old, ref, adv[:2], mask)


def test_linear_cross_entropy_works_only_for_the_inputs_that_need_a_gradient():
    h, w, labels = lm_head_case()
    expected_h, expected_w = torch.autograd.grad(cross_entropy(h @ w.t(), labels)[0], (h, w))
    frozen_head = w.detach()  # e.g. a frozen lm_head
    loss, _ = linear_cross_entropy(h, frozen_head, labels)
    (grad_h,) = torch.autograd.grad(loss, (h,))
    torch.testing.assert_close(grad_h, expected_h)
    frozen_body = h.detach()
    loss, _ = linear_cross_entropy(frozen_body, w, labels)
    (grad_w,) = torch.autograd.grad(loss, (w,))
    torch.testing.assert_close(grad_w, expected_w)


def test_linear_cross_entropy_under_fp16_autocast_keeps_small_weight_gradients():
    """The gradient matmuls stay in float32 under fp16 autocast: no softmax entry underflows to 0."""
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(64, 16, generator=gen, requires_grad=True)
    w = (4 * torch.randn(512, 16, generator=gen)).requires_grad_(True)  # peaked softmax: tiny entries
    labels = torch.randint(0, 512, (64,), generator=gen)
    expected = torch.autograd.grad(cross_entropy(h @ w.t(), labels)[0], (w,))[0]
    with torch.autocast("cpu", dtype=torch.float16):
        loss = linear_cross_entropy(h, w, labels)[0]
    (grad_w,) = torch.autograd.grad(loss, (w,))
    assert grad_w.dtype == torch.float32
    assert ((grad_w == 0) & (expected != 0)).sum() == 0
    torch.testing.assert_close(grad_w, expected, rtol=1e-2, atol=1e-3)
