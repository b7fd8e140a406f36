"""K/V read from a session file stay that session's own: a tampered file cannot change what other
requests decode, during the session, after its turns, through its forks or after it is closed."""

import time

import pytest
import torch
from test_session_files import rewrite

from astrai_pl.inference import SamplingParams

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
HEADER = list(range(3, 3 + 48))  # a shared prefix such as a system prompt: 3 pages of 16
VICTIM = HEADER + [100, 101, 102]


@pytest.fixture(scope="module")
def clean(model, make_engine, tmp_path_factory):
    """VICTIM's greedy output from an engine that never saw a file, and a tampered session file: one over
    HEADER, rewritten with finite random K/V of the same shape (so it is accepted)."""
    engine = make_engine(model, max_total_tokens=2048)
    expected = engine.generate(VICTIM, GREEDY)[0].token_ids
    return expected, scrambled_session(engine, tmp_path_factory.mktemp("session"))


def scrambled_session(engine, tmp_path):
    chat = engine.session()
    chat.append(HEADER)
    chat.save(tmp_path / "chat.safetensors")
    chat.close()
    g = torch.Generator().manual_seed(0)

    def noise(t):
        return torch.randn(t.shape, generator=g, dtype=t.dtype) * 5

    return rewrite(
        tmp_path / "chat.safetensors", tmp_path / "evil.safetensors", tensors={"k": noise, "v": noise}
    )


def test_a_tampered_session_file_never_changes_another_requests_output(model, make_engine, clean):
    expected, evil = clean
    engine = make_engine(model, max_total_tokens=2048)
    session = engine.load_session(evil)
    assert session.num_computed == len(HEADER)  # accepted: finite, right shapes, same model
    first = engine.generate(VICTIM, GREEDY)[0]
    assert first.token_ids == expected and first.cached_tokens == 0
    session.generate([7, 8, 9], SamplingParams(max_tokens=2))  # a finished turn publishes nothing either
    fork = session.fork()
    fork.generate([10], SamplingParams(max_tokens=2))
    assert engine.generate(VICTIM, GREEDY)[0].token_ids == expected
    fork.close()
    session.close()
    engine.check()
    victim_pages = (len(VICTIM) + GREEDY.max_tokens - 1) // 16  # the full pages of its computed tokens
    assert engine.usage().evictable == victim_pages  # the cache holds the victim's pages, none of the file's
    again = engine.generate(VICTIM, GREEDY)[0]
    assert again.token_ids == expected and again.cached_tokens == len(HEADER)
    engine.check()


def test_a_loaded_session_recomputed_by_the_engine_shares_its_prefix_again(model, make_engine, clean):
    expected, evil = clean
    engine = make_engine(model, max_total_tokens=2048)
    session = engine.load_session(evil, ttl=30.0)
    engine.expire_sessions(now=time.monotonic() + 60)
    assert engine.check().in_use == 0 and engine.usage().evictable == 0  # the file's pages were freed
    session.append([])  # the engine computes the header itself now
    got = engine.generate(VICTIM, GREEDY)[0]
    assert got.token_ids == expected and got.cached_tokens == len(HEADER)
    session.close()
    engine.check()


def test_a_preempted_turn_of_a_loaded_session_caches_nothing_of_the_file(model, make_engine, clean):
    expected, evil = clean
    engine = make_engine(model, max_total_tokens=2048)
    session = engine.load_session(evil)
    turn = session.stream([1, 2], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    next(turn)
    [req] = engine.scheduler.running
    engine.scheduler.preempt(req)  # what memory pressure does to the youngest request
    assert engine.usage().evictable == 0  # its pages were freed, none went to the prefix cache
    engine.check()
    list(turn)  # the turn goes on: the engine recomputes the whole conversation itself
    assert not session.kv_from_file and engine.stats.preemptions == 1
    got = engine.generate(VICTIM, GREEDY)[0]
    assert got.token_ids == expected and got.cached_tokens == len(HEADER)  # the engine's own K/V
    session.close()
    engine.check()
