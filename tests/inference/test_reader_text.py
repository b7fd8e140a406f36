"""Text made by the reader, not the step: the step decodes nothing of a streamed or stop-string request, a
stop string found after the engine ran past it ends the request as if found in the step (same text, ids,
finish reason, usage, session history), and what was made past the stop is freed and never cached.

References are the ids of the same greedy (or seeded) run without a stop string, cut where a `TextStream` fed
one id at a time first stops: exactly how the step used to end such a request."""

import sys
import threading
from dataclasses import replace
from pathlib import Path

import pytest
from test_text import TEXT, engine_for

from astrai_pl.inference import Engine, SamplingParams, SpeculativeConfig
from astrai_pl.inference.text import TextStream
from astrai_pl.model import ModelConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_speculative import copying_model  # noqa: E402

tokenizers = pytest.importorskip("astrai_pl.tokenizer")


@pytest.fixture
def tok():
    return tokenizers.Tokenizer.byte_level()


@pytest.fixture
def decodes(tok):
    """The tokenizer's decode, patched to record the name of each calling thread."""
    threads, decode = [], tok.decode

    def recording(ids, *args, **kwargs):
        threads.append(threading.current_thread().name)
        return decode(ids, *args, **kwargs)

    tok.decode = recording
    return threads


def reference(tok, ids: list[int], stop: list[str], end_ids=()) -> tuple[list[tuple[str, list[int]]], str, str]:
    """(text, ids) of each delta, the final text and finish reason of `ids` ending at the first stop string."""
    stream, deltas = TextStream(tok, stop), []
    for token in ids:
        if token in end_ids:
            deltas.append((stream.finish(), [token]))
            return deltas, stream.text, "stop"
        text = stream.push(token)
        if stream.stopped:
            deltas.append((text + stream.finish(), [token]))
            return deltas, stream.text, "stop"
        deltas.append((text, [token]))
    deltas[-1] = (deltas[-1][0] + stream.finish(), deltas[-1][1])
    return deltas, stream.text, "length"


def run_ahead(engine: Engine, handle) -> None:
    """Step the engine until it has nothing to compute, reading nothing of `handle`: it runs past any stop."""
    while sum(engine.load()):
        engine.drive()
    assert not handle.done  # a request with stop strings waits for its reader at its end


def test_the_step_decodes_nothing_of_streamed_or_stopping_requests(model, tok, decodes, random_prompts):
    prompt = random_prompts([9], seed=8, vocab=250)[0]
    engine = Engine(model, tok, max_total_tokens=4096, debug=True)
    free = engine.generate([prompt], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0]
    stopping = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop=[free.text[6:8]])
    decodes.clear()
    handle = engine.submit(prompt, stopping)
    run_ahead(engine, handle)  # every step of it, on this thread
    assert decodes == []
    assert handle.result()[0].text == free.text[: free.text.index(free.text[6:8])] and decodes
    decodes.clear()
    with engine:  # the background loop steps; this thread reads
        streamed = "".join(d.text for d in engine.stream(prompt, stopping))
        plain = "".join(d.text for d in engine.stream(prompt, SamplingParams(max_tokens=20, temperature=0)))
        [out] = engine.generate([prompt], stopping)
    assert streamed == out.text and plain and decodes
    assert set(decodes) == {threading.current_thread().name}  # never the engine's thread
    assert engine.check().in_use == 0


@pytest.mark.parametrize("stop", [["世界"], ["🙂!"], ["ï", "✓"], ["llo 世"], ["zz"]])
@pytest.mark.parametrize("ahead", [False, True])
def test_outputs_are_the_stream_cut_at_the_stop(tok, stop, ahead):
    """Multi-byte characters and stop strings spanning several ids; read at once or after the engine ran on."""
    ids = tok.encode(TEXT)
    eos = tok.eos_token_ids[0]
    deltas, text, reason = reference(tok, ids + [eos], stop, end_ids=[eos])
    engine = engine_for(tok, TEXT, extra=[eos, 40, 41])
    params = SamplingParams(temperature=0, max_tokens=64, stop=stop, logprobs=True)
    handle = engine.submit([10, 11, 12], params)
    if ahead:
        run_ahead(engine, handle)
    got = list(handle)
    assert [(d.text, d.token_ids) for d in got] == deltas and [len(d.logprobs) for d in got] == [1] * len(deltas)
    [out] = handle.result()
    kept = [t for _, token in deltas for t in token]
    assert (out.text, out.token_ids, out.finish_reason, len(out.logprobs)) == (text, kept, reason, len(kept))
    assert got[-1].completion == out and got[-1].finish_reason == reason
    [again] = engine.generate([[10, 11, 12]], params)
    assert (again.text, again.token_ids, again.finish_reason, again.logprobs) == (
        out.text, out.token_ids, out.finish_reason, out.logprobs)
    assert engine.check().in_use == 0


def test_n_samples_sessions_and_step_callers(model, tok, random_prompts):
    prompt = random_prompts([9], seed=3, vocab=250)[0]
    engine = Engine(model, tok, max_total_tokens=4096, debug=True)
    sampled = SamplingParams(max_tokens=24, temperature=1.0, seed=7, n=3, ignore_eos=True)
    free = engine.generate([prompt], sampled)
    stop = [free[1].text[4:6], free[2].text[9:10]]
    outs = engine.generate([prompt], replace(sampled, stop=stop))
    for f, out in zip(free, outs):
        deltas, text, reason = reference(tok, f.token_ids, stop)
        assert (out.text, out.token_ids, out.finish_reason) == (text, [t for _, d in deltas for t in d], reason)
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    line = engine.generate([prompt], greedy)[0]
    stopping = replace(greedy, stop=[line.text[5:7]])
    deltas, text, _ = reference(tok, line.token_ids, stopping.stop)
    session = engine.session()
    handle = session.submit(prompt, stopping)
    run_ahead(engine, handle)
    [turn] = handle.result()
    assert turn.text == text and session.tokens == prompt + turn.token_ids  # the history ends at the stop
    after = session.generate([40, 41, 42], greedy)
    fresh = Engine(model, tok, max_total_tokens=4096).generate([session.tokens[: -len(after.token_ids) - 3]
                                                                + [40, 41, 42]], greedy)[0]
    assert after.token_ids == fresh.token_ids
    rid = engine.add_request(prompt, stopping)
    stepped = []
    while engine.has_unfinished():
        stepped += engine.step()
    assert [(d.text, d.token_ids) for d in stepped] == deltas and stepped[-1].request_id == rid
    session.close()
    assert engine.check().in_use == 0


def test_generate_reads_every_prompt_as_it_comes(model, tok, random_prompts):
    """Each prompt's request is cut in the step after its stop, whichever handle generate is waiting on."""
    prompts = random_prompts([9, 11, 13], seed=4, vocab=250)
    engine = Engine(model, tok, max_total_tokens=4096, debug=True)
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    frees = engine.generate(prompts, greedy)
    params = [replace(greedy, stop=[f.text[i : i + 2]]) for f, i in zip(frees, (12, 3, 6))]
    before = engine.stats.decode_tokens
    outs = engine.generate(prompts, params)
    for f, p, out in zip(frees, params, outs):
        deltas, text, _ = reference(tok, f.token_ids, p.stop)
        assert (out.text, len(out.token_ids)) == (text, len(deltas))
    assert engine.stats.decode_tokens - before == sum(len(out.token_ids) - 1 for out in outs)  # none ran on


def test_speculative_steps_past_a_stop_are_cut(tok):
    copying, cycle = copying_model(ModelConfig.from_name("debug"), mix=0.25)
    prompt = cycle[:40] + cycle[:2]  # the output quotes the prompt: drafts are proposed and accepted
    spec = Engine(copying, tok, max_total_tokens=4096, debug=True, page_size=4,
                  speculative=SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=4, prompt_lookup_min=1))
    free = spec.generate([prompt], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0]
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=[free.text[9:11]])
    deltas, text, _ = reference(tok, free.token_ids, params.stop)
    handle = spec.submit(prompt, params)
    run_ahead(spec, handle)
    assert [(d.text, d.token_ids) for d in handle] == deltas and handle.result()[0].text == text
    assert spec.stats.accepted_draft_tokens > 0 and spec.check().in_use == 0


@pytest.mark.parametrize("steps_ahead", [3, None])
def test_a_stop_found_late_frees_its_pages_and_caches_nothing_past_it(model, tok, random_prompts, steps_ahead):
    prompt = random_prompts([10], seed=5, vocab=250)[0]
    engine = Engine(model, tok, max_total_tokens=4096, page_size=4, debug=True)
    free = engine.generate([prompt], SamplingParams(max_tokens=28, temperature=0, ignore_eos=True))[0]
    engine.reset_prefix_cache()
    params = SamplingParams(max_tokens=28, temperature=0, ignore_eos=True, stop=[free.text[6:8]])
    deltas, _, _ = reference(tok, free.token_ids, params.stop)
    k = len(deltas)
    handle, start = engine.submit(prompt, params), engine.stats.decode_tokens
    while sum(engine.load()) and (steps_ahead is None or engine.stats.decode_tokens - start < k + steps_ahead):
        engine.drive()
    assert engine.check().in_use > 0  # held past the stop, until read
    [out] = handle.result()
    assert len(out.token_ids) == k and engine.check().in_use == 0
    probe = engine.generate([prompt + free.token_ids], SamplingParams(max_tokens=1))[0]
    assert probe.cached_tokens == (len(prompt) + k - 1) // 4 * 4  # the full pages before the stop id, no more


def test_a_parked_request_nobody_reads_is_read_by_the_engine_when_its_pages_are_needed(model, tok, random_prompts):
    """A caller waits on one handle while another request's end waits, unread, for its reader and holds pages the
    first needs: the engine reads it then (rather than refusing the request it waits for as too big)."""
    short, long = random_prompts([9, 40], seed=2, vocab=250)
    greedy = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    free = Engine(model, tok, max_total_tokens=4096).generate([short, long], greedy)
    stopping = replace(greedy, max_tokens=4, stop=["never in the text"])
    small = Engine(model, tok, max_total_tokens=64, page_size=4, debug=True)
    parked, waited = small.submit(short, stopping), small.submit(long, greedy)
    assert waited.result()[0].token_ids == free[1].token_ids
    [out] = parked.result()
    assert (out.token_ids, out.finish_reason) == (free[0].token_ids[:4], "length")
    assert small.check().in_use == 0
