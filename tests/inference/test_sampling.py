"""Sampling: exact greedy, truncation sets respected, seeded requests independent of the batch, penalties."""

import pytest
import torch

from astrai_pl.inference import SamplingParams, SamplingParamsError
from astrai_pl.inference.sampling import apply_penalties, mask_top_k_top_p_min_p, sample

LOGITS = torch.tensor([3.0, 2.5, 2.0, 1.0, 0.5, 0.0, -1.0, -2.0])  # probabilities fall off fast


def draw(params: SamplingParams, n: int = 400, seed: int = 0) -> list[int]:
    torch.manual_seed(seed)
    tokens, _, _ = sample(LOGITS.repeat(n, 1), [params] * n, [[]] * n, [0] * n, [None] * n)
    return tokens


def test_temperature_zero_is_argmax_and_top_k_one_equals_greedy():
    assert set(draw(SamplingParams(temperature=0))) == {0}
    assert set(draw(SamplingParams(temperature=5.0, top_k=1))) == {0}


@pytest.mark.parametrize(
    "params, allowed",
    [
        (SamplingParams(top_k=3), {0, 1, 2}),
        (SamplingParams(top_p=0.5), {0, 1}),  # p = .44, .27, .16, ...: two tokens reach 0.5
        (SamplingParams(min_p=0.3), {0, 1, 2}),  # within 0.3 × the top probability
        (SamplingParams(top_k=5, top_p=0.9, min_p=0.1), {0, 1, 2}),
    ],
    ids=["top_k", "top_p", "min_p", "all"],
)
def test_samples_never_leave_the_kept_set(params, allowed):
    got = draw(params)
    assert set(got) == allowed  # every kept token shows up, nothing else does


def test_draws_follow_the_distribution():
    got = torch.tensor(draw(SamplingParams(temperature=1.0), n=20000))
    freq = torch.bincount(got, minlength=8).float() / len(got)
    torch.testing.assert_close(freq, LOGITS.softmax(-1), atol=0.015, rtol=0)


def test_nucleus_keeps_the_top_token_even_when_it_alone_exceeds_p():
    masked = mask_top_k_top_p_min_p(
        LOGITS[None], torch.tensor([0]), torch.tensor([0.01]), torch.tensor([0.0])
    )
    assert torch.isfinite(masked[0]).tolist() == [True] + [False] * 7


def test_penalties_follow_their_definitions():
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    apply_penalties(logits, SamplingParams(repetition_penalty=2.0), torch.tensor([0, 1, 0]), torch.tensor([]))
    assert logits.tolist() == [1.0, -4.0, 1.0, 0.5]
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    apply_penalties(logits, params, torch.tensor([3, 2, 2]), torch.tensor([2, 2]))
    assert logits.tolist() == [2.0, -2.0, 1.0 - 1.0 - 0.25, 0.5]  # only output tokens count


def test_presence_penalty_stops_repeats_in_greedy_output(model, make_engine, random_prompts):
    engine = make_engine(model, page_size=4)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, presence_penalty=100.0)
    [out] = engine.generate(random_prompts([6]), params)
    assert len(set(out.token_ids)) == 40


def test_a_seeded_request_reproduces_inside_different_batches(model, make_engine, random_prompts):
    prompt, *others = random_prompts([11, 4, 19, 27, 8])
    seeded = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    alone = make_engine(model, page_size=4).generate([prompt], seeded)[0].token_ids
    unseeded = SamplingParams(max_tokens=14, temperature=1.0, ignore_eos=True)
    batched = make_engine(model, page_size=16).generate(
        others[:2] + [prompt] + others[2:], [unseeded, unseeded, seeded, unseeded, unseeded]
    )
    assert batched[2].token_ids == alone
    other_seed = make_engine(model).generate([prompt], SamplingParams(**{**seeded.__dict__, "seed": 99}))
    assert other_seed[0].token_ids != alone


def test_top_k_one_equals_greedy_through_the_engine(model, make_engine, reference_greedy, random_prompts):
    prompt = random_prompts([13])[0]
    engine = make_engine(model, page_size=4)
    params = SamplingParams(max_tokens=10, temperature=1.3, top_k=1, ignore_eos=True, logprobs=True)
    [out] = engine.generate([prompt], params)
    assert out.token_ids == reference_greedy(model, prompt, 10)
    assert len(out.logprobs) == 10 and all(lp <= 0 for lp in out.logprobs)


@pytest.mark.parametrize(
    "field, value, hint",
    [
        ("temperature", -1.0, "greedy"),
        ("top_p", 0.0, "1.0"),
        ("top_k", -2, "disable"),
        ("min_p", 1.5, "disable"),
        ("n", 0, "at least one"),
        ("max_tokens", -1, "prefill"),
        ("repetition_penalty", 0.0, "no penalty"),
    ],
)
def test_bad_sampling_params_name_the_field_and_the_fix(field, value, hint):
    with pytest.raises(SamplingParamsError, match=rf"SamplingParams\.{field}={value!r}.*{hint}"):
        SamplingParams(**{field: value})


def test_a_single_stop_string_becomes_a_list():
    assert SamplingParams(stop="\n").stop == ["\n"]
