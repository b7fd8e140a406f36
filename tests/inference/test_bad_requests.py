"""Bad requests are refused at the door with one typed error, and a request that fails inside a step fails
alone: the engine releases it and serves every other request as if it had never been there."""

import math

import numpy as np
import pytest
import torch

import astrai_pl.inference.engine as engine_module
from astrai_pl.inference import CapacityError, InferenceError, SamplingParams, SamplingParamsError
from astrai_pl.inference.attention.backends import BackendUnavailable, attn_backend
from astrai_pl.inference.sampling import sample

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
POISON = [311, 313, 317]  # a prompt starting with these ids fails wherever a test injects a failure


def assert_serves_normally(engine, model, reference_greedy, prompt=(9, 40, 77, 12, 5)):
    """Nothing left behind: the books balance, nothing runs, and greedy output is the reference."""
    assert not engine.has_unfinished()
    engine.check()
    [out] = engine.generate([list(prompt)], GREEDY)
    assert out.token_ids == reference_greedy(model, list(prompt), 8)
    assert engine.check().in_use == 0


# -- prompts ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "prompt, shown",
    [
        ([5, 9999], "9999 at position 1"),
        ([-1, 5], "-1 at position 0"),
        ([5, 320], "320 at position 1"),  # one past the last id
        ([5, 2**70], f"{2**70} at position 1"),
        ([5, True], "True at position 1"),
        ([5, 6.0], "6.0 at position 1"),
        ([5, "7"], "'7' at position 1"),
        (torch.tensor([5.0, 6.0]), "5.0 at position 0"),
        (torch.tensor([[[5]]]), "must be 1-D"),
        (np.array([7, 1000]), "1000 at position 1"),
    ],
    ids=["9999", "negative", "vocab_size", "huge", "bool", "float", "str", "float_tensor", "3d", "numpy"],
)
def test_a_prompt_id_outside_the_vocabulary_is_refused_before_it_is_queued(
    prompt, shown, model, make_engine, reference_greedy
):
    engine = make_engine(model, page_size=4)
    with pytest.raises(ValueError, match=shown) as err:
        engine.generate([prompt], GREEDY)
    assert isinstance(err.value, InferenceError)
    if "position" in shown:
        assert "vocabulary of 320" in str(err.value)
    with pytest.raises(ValueError, match=shown):
        engine.add_request(prompt, GREEDY)
    assert_serves_normally(engine, model, reference_greedy)


def test_prompts_as_tensors_and_arrays_give_the_same_output_as_lists(model, make_engine, random_prompts):
    engine = make_engine(model, page_size=4)
    a, b = random_prompts([6, 9], seed=49)
    expected = [o.token_ids for o in engine.generate([a, b], GREEDY)]

    def outputs(prompts):
        return [o.token_ids for o in engine.generate(prompts, GREEDY)]

    assert outputs([torch.tensor(a), np.array(b)]) == expected
    assert (
        outputs([np.int64(t) for t in a]) == outputs(np.array(a)) == outputs(torch.tensor(a)) == expected[:1]
    )
    assert outputs(np.array([b, b])) == outputs(torch.tensor([b, b])) == [expected[1]] * 2


def test_stop_ids_outside_the_vocabulary_and_other_params_objects_are_refused(
    model, make_engine, reference_greedy
):
    engine = make_engine(model, page_size=4)
    with pytest.raises(SamplingParamsError, match="stop_token_ids holds 400.*vocabulary of 320"):
        engine.generate([[5, 6]], SamplingParams(stop_token_ids=[400]))
    with pytest.raises(SamplingParamsError, match="params must be SamplingParams, got dict"):
        engine.generate([[5, 6]], [{"max_tokens": 3}])
    assert_serves_normally(engine, model, reference_greedy)


def test_fields_changed_after_construction_are_checked_when_the_request_is_added(
    model, make_engine, reference_greedy
):
    engine = make_engine(model, page_size=4)
    for field, value in [("max_tokens", 2.5), ("temperature", math.nan), ("top_k", True)]:
        params = SamplingParams(max_tokens=4)
        setattr(params, field, value)
        with pytest.raises(SamplingParamsError, match=rf"SamplingParams\.{field}="):
            engine.generate([[5, 6]], params)
    assert_serves_normally(engine, model, reference_greedy)


# -- a failure inside a step -----------------------------------------------------------------------------
def poisoned(tokens) -> bool:
    return list(tokens[: len(POISON)]) == POISON


def run_mixed(engine, prompts, params):
    """Drive the engine with add_request/step; every request's final Delta."""
    ids = {engine.add_request(p, params): i for i, p in enumerate(prompts)}
    final = {}
    while engine.has_unfinished():
        for delta in engine.step():
            if delta.finish_reason is not None:
                final[ids[delta.request_id]] = delta
    return [final[i] for i in range(len(prompts))]


@pytest.mark.parametrize("where", ["forward", "sampler"])
def test_a_failure_in_one_requests_step_fails_only_that_request(
    where, model, make_engine, reference_greedy, random_prompts, monkeypatch
):
    engine = make_engine(model, page_size=4, max_step_tokens=24)
    if where == "forward":
        forward = engine.runner.forward

        def failing_forward(plan):
            if any(poisoned(req.tokens) for req, _ in plan):
                raise RuntimeError("injected forward failure")
            return forward(plan)

        monkeypatch.setattr(engine.runner, "forward", failing_forward)
    else:

        def failing_sample(logits, params, contexts, *rest):
            if any(poisoned(c) for c in contexts):
                raise RuntimeError("injected sampler failure")
            return sample(logits, params, contexts, *rest)

        monkeypatch.setattr(engine_module, "sample", failing_sample)
    good = random_prompts([7, 30, 12], seed=41)
    prompts = [good[0], POISON + [9, 10, 11], good[1], good[2]]
    finals = run_mixed(engine, prompts, GREEDY)
    assert finals[1].finish_reason == "error"
    assert f"injected {where} failure" in finals[1].completion.error
    for delta, prompt in zip([finals[0], finals[2], finals[3]], good):
        assert delta.finish_reason == "length"
        assert delta.completion.token_ids == reference_greedy(model, prompt, 8)
    assert engine.check().in_use == 0
    with pytest.raises(InferenceError, match=r"failed and was dropped.*injected"):
        engine.generate([POISON + [1], good[0]], GREEDY)
    with pytest.raises(InferenceError, match=r"failed and was dropped.*injected"):
        list(engine.stream(POISON + [2], GREEDY))
    assert_serves_normally(engine, model, reference_greedy)


def test_a_failed_session_turn_is_dropped_and_the_session_goes_on(
    model, make_engine, reference_greedy, random_prompts, monkeypatch
):
    engine = make_engine(model, page_size=4)
    first, second = random_prompts([10, 5], seed=48)
    chat = engine.session()
    reply = chat.generate(first, GREEDY)
    history = list(chat.tokens)
    forward = engine.runner.forward

    def failing_forward(plan):
        if any(POISON[0] in req.tokens[len(history) :] for req, _ in plan):
            raise RuntimeError("injected forward failure")
        return forward(plan)

    monkeypatch.setattr(engine.runner, "forward", failing_forward)
    with pytest.raises(InferenceError, match="injected"):
        chat.generate(POISON, GREEDY)
    assert chat.tokens == history and engine.check().in_use == 0  # its pages went back to the cache
    again = chat.generate(second, GREEDY)
    assert again.token_ids == reference_greedy(model, first + reply.token_ids + second, 8)
    chat.close()
    assert_serves_normally(engine, model, reference_greedy)


def test_a_failed_fork_sample_leaves_its_siblings_and_the_pool_intact(
    model, make_engine, random_prompts, monkeypatch
):
    engine = make_engine(model, page_size=4)
    calls = []

    def fail_first_call(*args):
        calls.append(1)
        if len(calls) == 1:  # the step where the prompt forks into its n samples
            raise RuntimeError("injected")
        return sample(*args)

    monkeypatch.setattr(engine_module, "sample", fail_first_call)
    params = SamplingParams(max_tokens=5, temperature=1.0, n=3, seed=7, ignore_eos=True)
    outs = engine.generate(random_prompts([10], seed=42), params)  # retried one sample at a time
    assert [len(o.token_ids) for o in outs] == [5, 5, 5] and engine.stats.forks == 2
    assert engine.check().in_use == 0


def test_an_engine_wide_error_in_a_step_leaves_other_requests_intact(
    model, make_engine, reference_greedy, random_prompts, monkeypatch
):
    monkeypatch.delenv("ASTRAI_BACKEND", raising=False)
    engine = make_engine(model, page_size=4)
    waiting, prompt = random_prompts([9, 6], seed=43)
    other = engine.add_request(waiting, GREEDY)  # another caller's request, queued
    with attn_backend("flash"), pytest.raises(BackendUnavailable):
        engine.generate([prompt], GREEDY)
    engine.check()  # the failed step was undone: no request holds pages past its K/V
    finals = {}
    while engine.has_unfinished():
        finals.update({d.request_id: d for d in engine.step() if d.completion is not None})
    assert finals[other].completion.token_ids == reference_greedy(model, waiting, 8)
    assert_serves_normally(engine, model, reference_greedy)


# -- sampling never leaves the vocabulary ----------------------------------------------------------------
NAN, INF = math.nan, math.inf


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(temperature=0),
        SamplingParams(temperature=1e-40),
        SamplingParams(top_p=0.5, top_k=3),
        SamplingParams(repetition_penalty=1e-30),
        SamplingParams(frequency_penalty=-3e38, presence_penalty=3e38),
    ],
    ids=["plain", "greedy", "tiny_temperature", "truncated", "tiny_repetition_penalty", "huge_penalties"],
)
def test_the_sampler_returns_a_vocabulary_id_whatever_the_logits(params):
    logits = torch.tensor(
        [
            [NAN] * 8,
            [-INF] * 8,
            [1.0, NAN, 2.0, 0.0, INF, 0.0, -INF, 0.0],
            [3.0, 2.9, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0],
        ]
    ).repeat(50, 1)
    torch.manual_seed(0)
    tokens, _, _ = sample(logits, [params] * 200, [[0, 1, 2, 4]] * 200, [2] * 200, [None] * 200)
    assert all(0 <= t < 8 for t in tokens)
    assert set(tokens[2::4]) == {4}  # +inf is certain


def test_a_vanishing_temperature_decodes_greedily_through_the_engine(
    model, make_engine, reference_greedy, random_prompts
):
    engine = make_engine(model, page_size=4)
    prompt = random_prompts([11], seed=44)[0]
    [out] = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=1e-40, ignore_eos=True))
    assert out.token_ids == reference_greedy(model, prompt, 8)
    assert_serves_normally(engine, model, reference_greedy)


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", 1e39),  # finite in float64, inf in the sampler's float32
        ("temperature", True),
        ("temperature", "0.7"),
        ("top_p", True),
        ("min_p", False),
        ("repetition_penalty", NAN),
        ("repetition_penalty", INF),
        ("frequency_penalty", NAN),
        ("frequency_penalty", -INF),
        ("presence_penalty", INF),
        ("presence_penalty", 10**400),
    ],
)
def test_float_fields_must_be_finite_numbers(field, value):
    with pytest.raises(SamplingParamsError, match=rf"SamplingParams\.{field}=.*; "):
        SamplingParams(**{field: value})


@pytest.mark.parametrize(
    "field, value, hint",
    [
        ("n", 2.5, "whole number"),
        ("n", True, "whole number"),
        ("max_tokens", 2.5, "whole number"),
        ("max_tokens", True, "whole number"),
        ("top_k", 1.5, "whole number"),
        ("seed", 2**64, "2\\*\\*64"),
        ("seed", -1, "2\\*\\*64"),
        ("seed", "1", "whole number"),
        ("stop_token_ids", ["a"], "'a', not a token id"),
        ("stop_token_ids", [True], "True, not a token id"),
        ("stop_token_ids", [-1], "-1, not a token id"),
        ("stop_token_ids", 5, "list"),
        ("stop", [1], "list of strings"),
        ("stop", None, "list of strings"),
        ("logprobs", "yes", "bool"),
        ("ignore_eos", 1, "bool"),
        ("skip_special_tokens", None, "bool"),
    ],
)
def test_every_field_refuses_a_wrong_type_naming_field_value_and_fix(field, value, hint):
    with pytest.raises(SamplingParamsError, match=rf"SamplingParams\.{field}=.*{hint}"):
        SamplingParams(**{field: value})


def test_a_seed_at_the_top_of_the_range_still_seeds_every_sample(model, make_engine, random_prompts):
    engine = make_engine(model, page_size=4)
    params = SamplingParams(max_tokens=3, n=2, seed=2**64 - 2, ignore_eos=True)
    assert len(engine.generate(random_prompts([6], seed=45), params)) == 2
    with pytest.raises(SamplingParamsError, match="seed"):
        SamplingParams(n=2, seed=2**64 - 1)


# -- capacity errors and aborts --------------------------------------------------------------------------
def test_abort_stops_every_sample_of_a_request(model, make_engine, random_prompts):
    engine = make_engine(model, page_size=4, prefix_cache=False)
    params = SamplingParams(max_tokens=20, temperature=1.0, n=3, ignore_eos=True)
    request_id = engine.add_request(random_prompts([9], seed=47)[0], params)
    engine.step()  # prefill, fork, first token of every sample
    engine.step()
    assert engine.stats.forks == 2
    engine.abort(request_id)
    assert not engine.has_unfinished()
    usage = engine.check()
    assert usage.free == usage.total


@pytest.mark.parametrize("loop", [False, True], ids=["callers-step", "background-loop"])
def test_a_request_that_cannot_fit_beside_sessions_fails_alone_and_the_queue_behind_it_is_served(
    model, make_engine, reference_greedy, random_prompts, loop
):
    engine = make_engine(model, page_size=4, max_total_tokens=64)  # 16 pages
    history, big, small = random_prompts([44, 25, 6], seed=48)
    chat = engine.session()
    chat.append(history)  # pins 11 pages
    if loop:
        engine.start()  # the background loop steps, as a server's does
    doomed = engine.submit(big, SamplingParams(max_tokens=4, temperature=0))  # fits only an empty pool
    behind = [engine.submit(small, GREEDY) for _ in range(2)]
    with pytest.raises(CapacityError):
        doomed.result()
    for handle in behind:
        [out] = handle.result()
        assert out.token_ids == reference_greedy(model, small, 8)
    engine.stop()
    assert not engine.has_unfinished()
    chat.close()
    assert_serves_normally(engine, model, reference_greedy)
