"""The engine's greedy output equals cache-free decoding under every layout, batch shape and memory pressure."""

import copy

import pytest
import torch

from astrai_pl.inference import CapacityError, EngineConfigError, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def run_staggered(engine, prompts, params, every: int = 2) -> list[list[int]]:
    """Add one prompt every `every` steps while the engine runs; the generated ids of each prompt."""
    pending, owner, results, steps = list(enumerate(prompts)), {}, {}, 0
    while pending or engine.has_unfinished():
        if pending and steps % every == 0:
            index, prompt = pending.pop(0)
            owner[engine.add_request(prompt, params)] = index
        for delta in engine.step():
            if delta.completion is not None:
                results[owner[delta.request_id]] = delta.completion.token_ids
        steps += 1
    return [results[i] for i in range(len(prompts))]


def test_greedy_decode_equals_reprefilling_at_every_step(
    model, make_engine, reference_greedy, random_prompts
):
    engine = make_engine(model, page_size=4)
    prompt = random_prompts([21])[0]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=True)
    [out] = engine.generate([prompt], params)
    assert out.token_ids == reference_greedy(model, prompt, 16)
    assert len(set(out.token_ids)) > 4  # the model is not stuck on one token
    with torch.no_grad():
        full = model(torch.tensor([prompt + out.token_ids])).logits[0].log_softmax(-1)
    expected = full[len(prompt) - 1 : -1].gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(out.logprobs), expected, atol=1e-5, rtol=0)
    assert out.finish_reason == "length" and out.prompt_token_ids == prompt


@pytest.mark.parametrize(
    "layout",
    [dict(page_size=1), dict(page_size=2), dict(page_size=16), dict(contiguous=True)],
    ids=["page1", "page2", "page16", "contiguous"],
)
def test_greedy_output_is_identical_across_page_sizes(
    layout, model, make_engine, reference_greedy, random_prompts
):
    prompts = random_prompts([5, 17, 33])
    engine = make_engine(model, max_batch_size=4, **layout)
    outs = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [reference_greedy(model, p, 12) for p in prompts]


def test_prefix_cache_cold_and_warm_give_the_same_output(
    model, make_engine, reference_greedy, random_prompts
):
    prompts = random_prompts([6, 17, 40])
    engine = make_engine(model, page_size=4)
    cold = engine.generate(prompts, GREEDY)
    warm = engine.generate(prompts, GREEDY)
    assert [o.cached_tokens for o in cold] == [0, 0, 0]
    assert [o.cached_tokens for o in warm] == [4, 16, 36]  # whole pages of all but the last prompt token
    assert [o.token_ids for o in warm] == [o.token_ids for o in cold]
    assert [o.token_ids for o in cold] == [reference_greedy(model, p, 12) for p in prompts]
    # the cache also holds the generated pages: prompt + output as a new prompt hits them
    [longer] = engine.generate([prompts[2] + cold[2].token_ids], GREEDY)
    assert longer.cached_tokens == (40 + 12 - 1) // 4 * 4  # the last sampled token had no K/V: not cached


def test_a_batch_of_eight_with_staggered_arrivals_matches_alone(
    model, make_engine, reference_greedy, random_prompts
):
    prompts = random_prompts([3, 30, 9, 50, 14, 22, 7, 41], seed=5)
    engine = make_engine(model, page_size=4, max_step_tokens=24)  # prompts arrive mid-prefill of others
    got = run_staggered(engine, prompts, GREEDY)
    assert got == [reference_greedy(model, p, 12) for p in prompts]
    assert engine.check().in_use == 0


def test_a_tiny_pool_evicts_and_preempts_without_changing_output(
    model, make_engine, reference_greedy, random_prompts
):
    prompts = random_prompts([12, 25, 9, 30, 17, 21, 14, 28], seed=7)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    engine = make_engine(model, page_size=4, max_total_tokens=112)
    engine.generate(random_prompts([20, 20], seed=8), params)  # leaves cached, evictable pages behind
    assert engine.usage().evictable > 0
    got = run_staggered(engine, prompts, params, every=1)
    stats = engine.stats
    assert stats.evicted_pages > 0 and stats.preemptions > 0
    assert got == [reference_greedy(model, p, 20) for p in prompts]
    usage = engine.check()
    assert usage.free + usage.evictable == usage.total


def test_shared_prefix_workload_prefills_ten_times_fewer_tokens(model, make_engine, random_prompts):
    system = random_prompts([384], seed=11)[0]
    prompts = [system + q for q in random_prompts([8] * 24, seed=12)]
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    counts, outputs = {}, {}
    for prefix_cache in (False, True):
        engine = make_engine(model, page_size=16, prefix_cache=prefix_cache, max_total_tokens=16384)
        outputs[prefix_cache] = [o.token_ids for o in engine.generate(prompts, params)]
        counts[prefix_cache] = engine.stats.prefill_tokens
    assert counts[False] == 24 * 392
    assert counts[True] == 392 + 23 * 8  # the system prompt once, then each question only
    assert counts[False] >= 10 * counts[True]
    assert outputs[True] == outputs[False]


def test_n_samples_share_the_prompt_prefill(model, make_engine, random_prompts):
    prompt = random_prompts([37])[0]
    engine = make_engine(model, page_size=4)
    outs = engine.generate(
        [prompt], SamplingParams(max_tokens=6, temperature=1.0, n=5, seed=3, ignore_eos=True)
    )
    assert [o.index for o in outs] == [0, 1, 2, 3, 4]
    assert engine.stats.prefill_tokens == 37 and engine.stats.forks == 4
    assert len({tuple(o.token_ids) for o in outs}) > 1  # different seeds, different samples
    assert all(o.cached_tokens == 37 for o in outs[1:])


def test_chunked_prefill_keeps_decodes_running(model, make_engine, random_prompts):
    short, long = random_prompts([5, 200], seed=2)
    engine = make_engine(model, page_size=4, max_step_tokens=32)
    first = engine.add_request(short, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    engine.step()
    engine.add_request(long, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    for _ in range(6):  # the long prompt needs ~7 chunks; the short request decodes every step meanwhile
        assert any(d.request_id == first and d.token_ids for d in engine.step())
    while engine.has_unfinished():
        engine.step()


def test_abort_releases_every_page(model, make_engine, random_prompts):
    engine = make_engine(model, page_size=4, prefix_cache=False)
    ids = [engine.add_request(p, GREEDY) for p in random_prompts([10, 20, 30])]
    engine.step()
    engine.step()
    assert engine.usage().in_use > 0
    for request_id in ids:
        engine.abort(request_id)
    assert not engine.has_unfinished()
    usage = engine.check()
    assert usage.free == usage.total


def test_stop_token_ids_end_the_completion(model, make_engine, reference_greedy, random_prompts):
    prompt = random_prompts([9])[0]
    expected = reference_greedy(model, prompt, 12)
    engine = make_engine(model, page_size=4)
    [out] = engine.generate(
        [prompt], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[expected[4]])
    )
    cut = expected.index(expected[4]) + 1
    assert out.token_ids == expected[:cut] and out.finish_reason == "stop"


def test_end_of_sequence_ids_come_from_config_tokenizer_and_generation_config(model, make_engine):
    class Tok:
        eos_token_ids = [4]

    model.generation_config = {"eos_token_id": [7, 9]}
    try:
        engine = make_engine(model, tokenizer=Tok())
    finally:
        del model.generation_config
    assert engine.eos_token_ids == {2, 4, 7, 9}


def test_bad_requests_and_arguments_are_refused(model, make_engine):
    engine = make_engine(model, page_size=4, max_total_tokens=64, max_batch_size=8)
    with pytest.raises(CapacityError, match="raise max_total_tokens or lower max_tokens or n"):
        engine.generate([[5] * 10], SamplingParams(max_tokens=100, n=8))
    with pytest.raises(CapacityError, match="max_batch_size"):
        engine.generate([[5] * 10], SamplingParams(max_tokens=2, n=9))
    with pytest.raises(CapacityError, match="context"):
        engine.generate([[5] * 64], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[]], SamplingParams())
    with pytest.raises(ValueError, match="needs a tokenizer"):
        engine.generate(["hello"], SamplingParams())
    with pytest.raises(ValueError, match="use generate"):  # refused at the call, not at the first delta
        engine.stream([5, 6], SamplingParams(n=2, max_tokens=4))
    with pytest.raises(ValueError, match="stop strings"):
        engine.generate([[5, 6]], SamplingParams(stop=["x"]))
    with pytest.raises(EngineConfigError, match="page_size=0"):
        make_engine(model, page_size=0)
    assert not engine.has_unfinished() and engine.check().in_use == 0


def test_the_engine_follows_in_place_weight_updates(model, make_engine, reference_greedy, random_prompts):
    """GRPO updates the policy between rollouts: the engine's (in, out) weight copies must not go stale."""
    policy = copy.deepcopy(model)
    engine = make_engine(policy)
    prompt = random_prompts([13])[0]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    [before] = engine.generate([prompt], params)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    engine.reset_prefix_cache()  # the cached K/V are stale; the copies follow the version counters
    [after] = engine.generate([prompt], params)
    assert after.token_ids == reference_greedy(policy, prompt, 8) != before.token_ids


def test_weights_changed_drops_weight_copies_a_fused_optimizer_left_stale(
    model, make_engine, reference_greedy, random_prompts
):
    """AdamW(fused=True) writes the weights without bumping their version counters."""
    policy = copy.deepcopy(model)
    engine = make_engine(policy)
    prompt = random_prompts([13])[0]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    [before] = engine.generate([prompt], params)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=0.05, fused=True)
    for p in policy.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    engine.reset_prefix_cache()  # the prefix cache alone: the copies stay, and are stale
    [stale] = engine.generate([prompt], params)
    assert stale.token_ids != reference_greedy(policy, prompt, 8)
    engine.weights_changed()
    [after] = engine.generate([prompt], params)
    assert after.token_ids == reference_greedy(policy, prompt, 8) != before.token_ids
