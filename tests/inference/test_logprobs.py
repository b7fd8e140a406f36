"""Log-probabilities the engine reports: the chosen token's, its most likely alternatives, per delta while
streaming, and the prompt's own tokens (`prompt_logprobs`, which the prefix cache must not skip)."""

import pytest
import torch

from astrai_pl.inference import SamplingParams, SamplingParamsError


@torch.no_grad()
def full_log_softmax(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def test_top_logprobs_are_the_models_likeliest_tokens(model, make_engine, random_prompts):
    engine = make_engine(model, page_size=4)
    prompt = random_prompts([13])[0]
    [out] = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, top_logprobs=5))
    assert out.logprobs is not None and len(out.top_logprobs) == 6  # top_logprobs turns logprobs on
    full = full_log_softmax(model, prompt + out.token_ids)
    for i, (token, chosen, top) in enumerate(zip(out.token_ids, out.logprobs, out.top_logprobs)):
        row = full[len(prompt) - 1 + i]
        values, ids = row.topk(5)
        assert [t for t, _ in top] == ids.tolist()
        torch.testing.assert_close(torch.tensor([lp for _, lp in top]), values, atol=1e-5, rtol=0)
        assert top[0][0] == token and abs(top[0][1] - chosen) < 1e-6  # greedy picks the likeliest


def test_streamed_deltas_carry_the_logprobs_of_their_tokens(model, make_engine, random_prompts):
    engine = make_engine(model)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, top_logprobs=2)
    deltas = list(engine.stream(random_prompts([9])[0], params))
    final = deltas[-1].completion
    assert [lp for d in deltas for lp in d.logprobs] == final.logprobs
    assert [alt for d in deltas for alt in d.top_logprobs] == final.top_logprobs
    assert all(len(d.logprobs) == len(d.token_ids) for d in deltas)


def test_prompt_logprobs_score_every_prompt_token_even_when_its_prefix_is_cached(
    model, make_engine, random_prompts
):
    engine = make_engine(model, page_size=4)
    prompt = random_prompts([30])[0]
    engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0))  # the prompt is now cached
    [out] = engine.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=3))
    assert out.cached_tokens == 0 and out.prompt_logprobs[0] is None
    full = full_log_softmax(model, prompt)
    for position in range(1, len(prompt)):
        chosen, top = out.prompt_logprobs[position]
        assert abs(chosen - float(full[position - 1, prompt[position]])) < 1e-5
        assert [t for t, _ in top] == full[position - 1].topk(3).indices.tolist()


def test_prompt_logprobs_start_keeps_the_cache_for_the_unscored_context(model, make_engine, random_prompts):
    """A continuation scored after a shared context (lm-eval's loglikelihood): the context comes from the
    cache, the continuation's tokens are scored, in chunks smaller than the prompt as well."""
    engine = make_engine(model, page_size=4, max_step_tokens=8)
    context, continuation = random_prompts([24, 7])
    engine.generate([context], SamplingParams(max_tokens=1, temperature=0))
    params = SamplingParams(max_tokens=0, prompt_logprobs=0, prompt_logprobs_start=len(context))
    [out] = engine.generate([context + continuation], params)
    assert out.cached_tokens > 0
    assert out.prompt_logprobs[: len(context)] == [None] * len(context)
    full = full_log_softmax(model, context + continuation)
    for position in range(len(context), len(context) + len(continuation)):
        chosen, top = out.prompt_logprobs[position]
        assert top == [] and abs(chosen - float(full[position - 1, (context + continuation)[position]])) < 1e-5


def test_samples_of_one_prompt_share_its_prompt_logprobs(model, make_engine, random_prompts):
    engine = make_engine(model)
    outs = engine.generate(random_prompts([11]), SamplingParams(max_tokens=3, n=3, seed=1, prompt_logprobs=1))
    assert len(outs) == 3 and all(o.prompt_logprobs == outs[0].prompt_logprobs for o in outs)
    assert all(entry is not None for entry in outs[0].prompt_logprobs[1:])


@pytest.mark.parametrize(
    "field, value, message",
    [("top_logprobs", 21, "at most 20"), ("top_logprobs", True, "whole number"),
     ("prompt_logprobs", -1, ">= 0"), ("prompt_logprobs", 2.0, "whole number"),
     ("prompt_logprobs_start", -1, ">= 0")],
)
def test_logprob_fields_are_checked(field, value, message):
    with pytest.raises(SamplingParamsError, match=f"{field}.*{message}"):
        SamplingParams(**{field: value})


def test_load_counts_running_and_waiting_requests(model, make_engine, random_prompts):
    """What a server's metrics show: queued requests wait, a step runs them, finished ones leave."""
    engine = make_engine(model, max_batch_size=2)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in random_prompts([5, 6, 7])]
    assert engine.load() == (0, 3)
    engine.step()
    assert engine.load() == (2, 1)
    while engine.has_unfinished():
        engine.step()
    assert engine.load() == (0, 0) and len(ids) == 3


def test_n_samples_of_a_prefill_only_request_all_finish(model, make_engine, random_prompts):
    """max_tokens=0 with n > 1 (a scored prompt asked for several times) gives n empty completions."""
    engine = make_engine(model, page_size=4)
    outs = engine.generate(random_prompts([10]), SamplingParams(max_tokens=0, n=3, prompt_logprobs=0))
    assert [(o.index, o.token_ids, o.finish_reason) for o in outs] == [(i, [], "length") for i in range(3)]
    assert all(o.prompt_logprobs == outs[0].prompt_logprobs for o in outs)
    assert engine.usage().in_use == 0


def test_a_streams_first_delta_carries_the_prompt_logprobs(model, make_engine, random_prompts):
    """A streamed echo can show the prompt's scores before the first token, not only at the end."""
    engine = make_engine(model)
    deltas = list(engine.stream(random_prompts([9])[0], SamplingParams(max_tokens=4, prompt_logprobs=0)))
    assert deltas[0].prompt_logprobs == deltas[-1].completion.prompt_logprobs
    assert deltas[0].prompt_logprobs[1] is not None
    assert all(d.prompt_logprobs is None for d in deltas[1:])
