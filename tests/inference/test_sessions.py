"""Sessions: turns equal one-shot decoding, forks are independent, save/load round-trips, TTL unpins."""

import time

import pytest

from astrai_pl.inference import SamplingParams, SessionError

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def test_continuing_a_session_equals_one_shot_and_skips_the_history(
    model, make_engine, reference_greedy, random_prompts
):
    first, second = random_prompts([13, 6], seed=21)
    engine = make_engine(model, page_size=4)
    chat = engine.session()
    reply1 = chat.generate(first, GREEDY)
    before = engine.stats.prefill_tokens
    reply2 = chat.generate(second, GREEDY)
    assert engine.stats.prefill_tokens - before == len(second) + 1  # the new turn and the last reply token
    assert reply2.cached_tokens == len(first) + 8 - 1
    assert reply1.token_ids == reference_greedy(model, first, 8)
    assert reply2.token_ids == reference_greedy(model, first + reply1.token_ids + second, 8)
    assert chat.tokens == first + reply1.token_ids + second + reply2.token_ids
    usage = engine.check()
    assert usage.in_use == len(chat.pages) > 0  # at idle only the session pins pages


def test_append_keeps_logits_so_the_next_turn_computes_nothing(
    model, make_engine, reference_greedy, random_prompts
):
    prompt = random_prompts([10], seed=22)[0]
    engine = make_engine(model, page_size=4)
    chat = engine.session()
    chat.append(prompt)
    assert chat.num_computed == len(prompt) and chat.last_logits is not None
    before = engine.stats.prefill_tokens + engine.stats.decode_tokens
    reply = chat.generate(None, SamplingParams(max_tokens=1, temperature=0))
    assert engine.stats.prefill_tokens + engine.stats.decode_tokens == before  # sampled from the kept logits
    assert reply.token_ids == reference_greedy(model, prompt, 1)


@pytest.mark.parametrize("page_size", [4, 5])
def test_forks_are_independent_and_leave_the_parent_unchanged(
    page_size, model, make_engine, reference_greedy, random_prompts
):
    base, left, right = random_prompts([11, 5, 7], seed=23)
    engine = make_engine(model, page_size=page_size)
    parent = engine.session()
    reply = parent.generate(base, GREEDY)
    history, pages = list(parent.tokens), list(parent.pages)
    child = parent.fork()
    assert (
        child.pages[:-1] == parent.pages[:-1] and child.pages[-1] != parent.pages[-1]
    )  # partial page copied
    assert child.memory().shared_pages == len(child.pages) - 1
    child_reply = child.generate(left, GREEDY)
    assert parent.tokens == history and parent.pages == pages
    parent_reply = parent.generate(right, GREEDY)
    assert child_reply.token_ids == reference_greedy(model, base + reply.token_ids + left, 8)
    assert parent_reply.token_ids == reference_greedy(model, base + reply.token_ids + right, 8)
    child.close()
    parent.close()
    assert engine.check().in_use == 0


def test_save_then_load_in_a_fresh_engine_continues_identically(
    model, other_model, make_engine, random_prompts, tmp_path
):
    first, second = random_prompts([14, 5], seed=24)
    engine = make_engine(model, page_size=4)
    chat = engine.session()
    chat.generate(first, GREEDY)
    chat.save(tmp_path / "chat.safetensors")
    expected = chat.generate(second, GREEDY).token_ids
    fresh = make_engine(model, page_size=4)
    loaded = fresh.load_session(tmp_path / "chat.safetensors")
    assert loaded.num_computed == len(first) + 7
    before = fresh.stats.prefill_tokens
    assert loaded.generate(second, GREEDY).token_ids == expected
    assert fresh.stats.prefill_tokens - before == len(second) + 1  # nothing recomputed from the file
    with pytest.raises(SessionError, match="different model.*same weights"):
        make_engine(other_model, page_size=4).load_session(tmp_path / "chat.safetensors")
    fresh.check()


def test_expiry_unpins_pages_which_become_evictable(model, make_engine, reference_greedy, random_prompts):
    first, second = random_prompts([18, 4], seed=25)
    engine = make_engine(model, page_size=4)
    chat = engine.session(ttl=30.0)
    reply = chat.generate(first, GREEDY)
    pinned = engine.usage()
    assert pinned.in_use == len(chat.pages) and not chat.due()
    assert engine.expire_sessions(now=time.monotonic() + 60) == [chat]
    usage = engine.check()
    full_pages = (len(first) + 8 - 1) // 4
    assert usage.in_use == 0 and usage.evictable == full_pages  # the partial page was freed
    assert chat.expired and chat.pages == [] and len(chat.tokens) == len(first) + 8
    again = chat.generate(second, GREEDY)  # still continues: the cached pages are found again
    assert again.cached_tokens == full_pages * 4
    assert again.token_ids == reference_greedy(model, first + reply.token_ids + second, 8)


def test_sessions_report_memory_and_refuse_misuse(model, make_engine, random_prompts):
    engine = make_engine(model, page_size=4)
    chat = engine.session()
    chat.generate(random_prompts([9])[0], GREEDY)
    memory = chat.memory()
    assert (memory.tokens, memory.cached_tokens, memory.pages) == (17, 16, 4)
    assert memory.bytes == 4 * 4 * engine.pool.storage.bytes_per_token
    with pytest.raises(SessionError, match="n=2.*fork"):
        chat.generate([5], SamplingParams(n=2))
    stream = chat.stream([5, 6], GREEDY)
    next(stream)
    with pytest.raises(SessionError, match="wait for that turn"):
        chat.generate([7], GREEDY)
    stream.close()  # abandoning the turn gives the session back what was computed
    chat.close()
    with pytest.raises(SessionError, match="closed"):
        chat.generate([7], GREEDY)
    assert engine.check().in_use == 0 and not engine.sessions
