"""Whichever caller runs a step, each delta reaches its own consumer exactly once: streams iterated side
by side, and a stream beside add_request/step() or generate(), lose and repeat nothing."""

from dataclasses import replace

import pytest

from astrai_pl.inference import SamplingParams
from astrai_pl.tokenizer import Tokenizer

LONG = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)


@pytest.fixture
def engine(model, make_engine):
    return make_engine(model, tokenizer=Tokenizer.byte_level())


def pull(streams: dict, pattern: str) -> dict:
    """Iterate `streams` by name in the repeating order of `pattern`; every delta each one yielded."""
    got, live = {name: [] for name in streams}, set(streams)
    while live:
        for name in pattern:
            if name in live:
                try:
                    got[name].append(next(streams[name]))
                except StopIteration:
                    live.discard(name)
    return got


def assert_whole(deltas, completion):
    """The deltas add up to `completion`: every id once, the text, and the end on the last delta only."""
    assert [t for d in deltas for t in d.token_ids] == completion.token_ids
    assert "".join(d.text for d in deltas) == completion.text
    assert [d.finish_reason is not None for d in deltas] == [False] * (len(deltas) - 1) + [True]
    assert deltas[-1].completion.token_ids == completion.token_ids


@pytest.mark.parametrize("pattern", ["ab", "aab", "abbb"])
def test_two_streams_side_by_side_equal_two_generate_calls(engine, pattern):
    expected = {"a": engine.generate("Hello there", LONG)[0], "b": engine.generate("Goodbye now", SHORT)[0]}
    streams = {"a": engine.stream("Hello there", LONG), "b": engine.stream("Goodbye now", SHORT)}
    got = pull(streams, pattern)
    for name in "ab":
        assert_whole(got[name], expected[name])
    engine.check()


def test_a_stream_beside_add_request_and_step_loses_nothing_of_either(engine):
    expected_stream = engine.generate("Hello there", LONG)[0]
    expected_added = engine.generate("Goodbye now", replace(SHORT, n=2))
    added = engine.add_request("Goodbye now", replace(SHORT, n=2))
    stream = engine.stream("Hello there", LONG)
    streamed, stepped = [], []
    for delta in stream:  # a step() between every two pulls of the stream
        streamed.append(delta)
        stepped += engine.step()
    while engine.has_unfinished():
        stepped += engine.step()
    assert_whole(streamed, expected_stream)
    assert {d.request_id for d in stepped} == {added, added + ".1"}  # none of the stream's
    for sample, completion in zip((added, added + ".1"), expected_added):
        assert_whole([d for d in stepped if d.request_id == sample], completion)
    engine.check()


@pytest.mark.parametrize("added_params, generate_params", [(LONG, SHORT), (SHORT, LONG)])
def test_generate_keeps_the_deltas_of_added_requests_for_the_next_step(engine, added_params, generate_params):
    expected = engine.generate("Goodbye now", added_params)[0]
    added = engine.add_request("Goodbye now", added_params)
    engine.generate("Hello there", generate_params)  # its steps run the added request too (maybe to its end)
    stepped = []
    while engine.has_unfinished():  # also while step() has deltas left from generate's steps
        stepped += engine.step()
    assert {d.request_id for d in stepped} == {added}
    assert_whole(stepped, expected)
    engine.check()
