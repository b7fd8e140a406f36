"""The batched sampler against a row-at-a-time reference: every option combination, seeded rows in any batch,
and one read back to the host per call."""

import itertools

import pytest
import torch

from astrai_pl.inference import SamplingParams
from astrai_pl.inference.sampling import (
    _finite,
    apply_penalties,
    mask_top_k_top_p_min_p,
    penalise,
    sample,
    seeded_uniform,
)

V = 40
COMBOS = [
    dict(temperature=t, top_k=k, top_p=p, min_p=m, **pen)
    for t, k, p, m, pen in itertools.product(
        (0.0, 0.7, 1.0), (0, 5), (1.0, 0.8), (0.0, 0.1),
        ({}, {"repetition_penalty": 1.3}, {"frequency_penalty": 0.4, "presence_penalty": 0.7}),
    )
]  # fmt: skip


def reference_row(logits, params, context, num_output, seed):
    """One row alone, the way the sampler's docstring reads: penalties, temperature, truncation, inverse CDF."""
    row = _finite(logits.clone())
    ctx = torch.tensor(context, dtype=torch.int64)
    apply_penalties(row, params, ctx, ctx[len(ctx) - num_output :])
    row = _finite(row)
    if params.greedy:
        return int(row.argmax())
    row = (row - row.max()) / torch.tensor(params.temperature, dtype=torch.float32)
    if params.truncated:
        row = mask_top_k_top_p_min_p(
            row[None], torch.tensor([min(params.top_k, V)]), torch.tensor([params.top_p]), torch.tensor([params.min_p])
        )[0]
    cdf = row.softmax(-1).double().cumsum(-1)
    u = seeded_uniform(torch.tensor([seed]), torch.tensor([num_output]))[0] * cdf[-1]
    return int(torch.searchsorted(cdf, u[None], right=True).clamp_max(V - 1))


def batch(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, V, generator=gen) * 3
    contexts = [torch.randint(0, V, (int(torch.randint(1, 12, (1,), generator=gen)),), generator=gen).tolist()
                for _ in range(n)]
    num_outputs = [int(torch.randint(0, len(c) + 1, (1,), generator=gen)) for c in contexts]
    return logits, contexts, num_outputs


def test_every_option_combination_samples_as_the_row_alone_reference():
    n = len(COMBOS)
    logits, contexts, num_outputs = batch(n)
    params = [SamplingParams(seed=100 + i, **c) for i, c in enumerate(COMBOS)]
    seeds = [p.seed for p in params]
    tokens, _, _ = sample(logits, params, contexts, num_outputs, seeds)
    want = [reference_row(logits[i], params[i], contexts[i], num_outputs[i], seeds[i]) for i in range(n)]
    assert tokens == want
    assert len(set(tokens)) > 10  # the combinations really draw different tokens


def test_batched_penalties_equal_the_row_reference_exactly():
    logits, contexts, num_outputs = batch(12, seed=3)
    params = [SamplingParams(repetition_penalty=r, frequency_penalty=f, presence_penalty=p)
              for r, f, p in itertools.product((1.0, 0.5, 2.0), (0.0, 1.5), (0.0, -0.25))][:12]
    got = penalise(logits.clone(), params, contexts, num_outputs)
    for i, p in enumerate(params):
        row = logits[i].clone()
        ctx = torch.tensor(contexts[i])
        apply_penalties(row, p, ctx, ctx[len(ctx) - num_outputs[i] :])
        assert torch.equal(got[i], row), i


def test_a_seeded_row_draws_the_same_in_any_batch_and_position():
    logits, contexts, num_outputs = batch(9, seed=5)
    seeded = SamplingParams(temperature=1.2, top_p=0.9, seed=7)
    alone = sample(logits[4:5], [seeded], contexts[4:5], num_outputs[4:5], [7])[0][0]
    others = [SamplingParams(temperature=t, top_k=k) for t, k in [(0.0, 0), (1.0, 3), (0.5, 0), (2.0, 10)]] * 2
    for order in ([4, 0, 1, 2, 3, 5, 6, 7, 8], [0, 1, 2, 3, 5, 6, 7, 8, 4], [8, 4, 2]):
        params = [seeded if i == 4 else others[i % len(others)] for i in order]
        seeds = [7 if i == 4 else None for i in order]
        tokens, _, _ = sample(logits[order], params, [contexts[i] for i in order], [num_outputs[i] for i in order],
                              seeds)
        assert tokens[order.index(4)] == alone


def test_seeded_uniform_is_splitmix64_of_the_seed_and_the_count():
    mask = (1 << 64) - 1

    def mix(z):
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    gamma = 0x9E3779B97F4A7C15
    cases = [(0, 0), (1, 0), (1, 1), (2**63 + 5, 17), (2**64 - 2, 3), (123456789, 10**6)]
    signed = [s - (1 << 64) if s >= 1 << 63 else s for s, _ in cases]
    got = seeded_uniform(torch.tensor(signed), torch.tensor([c for _, c in cases])).tolist()
    want = [(mix((mix((s + gamma) & mask) + (c + 1) * gamma) & mask) >> 11) * 2.0**-53 for s, c in cases]
    assert got == want
    assert all(0 <= u < 1 for u in got)


READ_BACKS = ("item", "tolist", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__")


@pytest.mark.parametrize("logprobs", [0, 3], ids=["ids", "ids_and_logprobs"])
def test_one_read_back_per_call_whatever_the_options(monkeypatch, logprobs):
    n = len(COMBOS)
    logits, contexts, num_outputs = batch(n, seed=9)
    params = [SamplingParams(seed=i if i % 2 else None, top_logprobs=logprobs, **c) for i, c in enumerate(COMBOS)]
    reads = []
    for name in READ_BACKS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            reads.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    tokens, chosen, top = sample(logits, params, contexts, num_outputs, [p.seed for p in params])
    monkeypatch.undo()
    assert reads == ["tolist"]
    assert len(tokens) == n and (chosen is None) == (logprobs == 0)
    if logprobs:
        assert [len(t) for t in top] == [3] * n and all(t[0][1] >= t[1][1] for t in top)


@pytest.mark.cuda
def test_on_the_gpu_nothing_waits_for_the_host_before_the_read_back():
    """Penalties, truncation and seeded draws of every combination, with CUDA's sync checker set to raise."""
    from astrai_pl.inference.sampling import _draw

    n = len(COMBOS)
    logits, contexts, num_outputs = batch(n, seed=11)
    params = [SamplingParams(seed=i if i % 2 else None, **c) for i, c in enumerate(COMBOS)]
    logits = logits.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        penalised = penalise(logits.clone(), params, contexts, num_outputs)
        drawn = _draw(_finite(penalised), params, num_outputs, [p.seed for p in params])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    cpu = penalise(logits.cpu(), params, contexts, num_outputs)
    torch.testing.assert_close(penalised.cpu(), cpu)
    assert drawn.shape == (n,) and bool(((drawn >= 0) & (drawn < V)).all())
