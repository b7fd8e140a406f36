"""Text off the step's path: a request whose text nobody reads before it ends (generate, rollouts) and that has
no stop string is decoded once, at its end, and reads exactly as the streamed text of the same request."""

import pytest

from astrai_pl.inference import Engine, SamplingParams

tokenizers = pytest.importorskip("astrai_pl.tokenizer")


@pytest.fixture
def counted():
    """A byte-level tokenizer and the list of the id lists it was asked to decode."""
    tok = tokenizers.Tokenizer.byte_level()
    calls, decode = [], tok.decode

    def counting(ids, *args, **kwargs):
        calls.append(list(ids))
        return decode(ids, *args, **kwargs)

    tok.decode = counting
    return tok, calls


def test_generate_decodes_once_at_the_end_and_reads_as_streamed(model, counted, random_prompts):
    tok, calls = counted
    engine = Engine(model, tok, max_total_tokens=4096, debug=True)
    prompts = random_prompts([9, 14], seed=8, vocab=250)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    streamed = ["".join(d.text for d in engine.stream(p, params)) for p in prompts]
    assert len(calls) >= 2 * 24 * len(prompts)  # streaming decodes at every step
    calls.clear()
    outs = engine.generate(prompts, params)
    assert [o.text for o in outs] == streamed and all(o.text for o in outs)
    assert len([ids for ids in calls if ids]) == len(prompts)  # one decode of each whole output
    sampled = engine.generate(prompts[:1], SamplingParams(max_tokens=12, n=3, seed=5, ignore_eos=True))
    assert [o.text for o in sampled] == [tok.decode(o.token_ids) for o in sampled]  # forked samples defer too


def test_a_stop_string_is_still_looked_for_at_every_step(model, counted, random_prompts):
    tok, calls = counted
    engine = Engine(model, tok, max_total_tokens=4096, debug=True)
    prompt = random_prompts([9], seed=8, vocab=250)[0]
    free = engine.generate([prompt], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0]
    stop = free.text[5:7]
    calls.clear()
    [out] = engine.generate([prompt], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop]))
    assert out.finish_reason == "stop" and out.text == free.text[: free.text.index(stop)]
    assert len(calls) > 2
