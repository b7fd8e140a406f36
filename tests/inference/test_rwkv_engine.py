"""The engine over an RWKV model: greedy decoding equal to transformers' RwkvForCausalLM.generate (cold, from
prefix snapshots, under slot pressure with preemption), state bytes constant in the context, chunked prefill,
snapshots evicted and dropped, the shared sampler's options, and sessions' turns on states."""

import dataclasses

import pytest
import torch

from astrai_pl.inference import Engine, SamplingParams
from astrai_pl.inference.recurrent.session import StateSession
from astrai_pl.inference.sessions import SessionError
from astrai_pl.model import ModelConfig, Transformer
from astrai_pl.model.rwkv import LayerState, RwkvState

transformers = pytest.importorskip("transformers")

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(ours, transformers') on the same random weights: our rwkv-debug model (narrowed) saved with
    save_pretrained and read back by transformers."""
    torch.manual_seed(0)
    ours = Transformer(ModelConfig.from_name("rwkv-debug", hidden_size=32, intermediate_size=128)).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * (0.5 if p.dim() == 2 else 0.2))
    path = tmp_path_factory.mktemp("rwkv")
    ours.save_pretrained(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    hf.generation_config.eos_token_id = None  # every token is generated, as ignore_eos does
    hf.generation_config.pad_token_id = 0
    return ours, hf


def hf_greedy(hf, prompt: list[int], max_tokens: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


def prompts(n: int, length: int, shared: int = 0, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    head = torch.randint(3, 320, (shared,), generator=gen).tolist()
    return [head + torch.randint(3, 320, (length,), generator=gen).tolist() for _ in range(n)]


def engine(model, **kwargs) -> Engine:
    kwargs.setdefault("max_total_tokens", 4096)
    return Engine(model, debug=True, page_size=8, **kwargs)


def test_greedy_equals_transformers_generate_cold(exported):
    ours, hf = exported
    batch = prompts(4, 11) + prompts(1, 3, seed=1)
    outs = engine(ours).generate(batch, GREEDY)
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 12) for p in batch]
    assert all(o.cached_tokens == 0 for o in outs)


def test_a_shared_prompt_is_computed_once_from_its_snapshots(exported):
    ours, hf = exported
    eng = engine(ours)
    batch = prompts(6, 5, shared=40)
    outs = eng.generate(batch, GREEDY)
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 12) for p in batch]
    # the first computes the 40 shared tokens; the others wait for it and start from its snapshot at 40
    assert [o.cached_tokens for o in outs] == [0] + [40] * 5
    assert eng.stats.cached_tokens == 200 and eng.stats.prefill_tokens == sum(map(len, batch)) - 200
    again = eng.generate(batch[:1], GREEDY)[0]  # warm: its own prompt, up to the last page boundary
    assert again.token_ids == outs[0].token_ids and again.cached_tokens == 40


def test_one_forward_per_chunk_snapshots_every_page_boundary_as_a_fresh_prefill_of_it(exported, monkeypatch):
    ours, hf = exported
    eng = engine(ours)
    forwards = []
    hidden_states = ours.hidden_states

    def counted(ids, **kwargs):
        forwards.append(ids.shape)
        return hidden_states(ids, **kwargs)

    monkeypatch.setattr(ours, "hidden_states", counted)
    prompt = prompts(1, 45, seed=9)[0]  # page boundaries at 8, 16, 24, 32 and 40
    assert eng.generate([prompt], GREEDY)[0].token_ids == hf_greedy(hf, prompt, 12)
    assert forwards[0] == (1, 45) and len(forwards) == eng.stats.steps == 12  # the prompt, then 11 decodes
    snaps, matched = eng.pool.radix.match(prompt)
    assert matched == 40 and len(snaps) == 5
    for n, snap in enumerate(snaps, 1):
        with torch.no_grad():
            ours(torch.tensor([prompt[: 8 * n]]), cache=(fresh := RwkvState()))
        row = eng.pool.num_slots + snap
        for c, name in enumerate(LayerState._fields):
            want = torch.stack([layer[c][0] for layer in fresh.layers])
            got = eng.pool.rows[c][:, row]
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=f"{8 * n}: {name}")


def test_preempted_requests_resume_from_their_saved_state_and_decode_as_without_pressure(exported):
    ours, _ = exported
    batch = prompts(4, 9, shared=8, seed=2)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    roomy = engine(ours).generate(batch, params)
    eng = engine(ours, max_batch_size=2, max_step_tokens=6)  # two slots, prompts in chunks of at most 6
    assert [o.token_ids for o in eng.generate(batch, params)] == [o.token_ids for o in roomy]
    stats = eng.stats
    assert stats.preemptions > 0 and eng.usage().held_states == 0
    assert stats.prefill_tokens + stats.cached_tokens == sum(map(len, batch))  # nothing computed twice
    assert stats.decode_tokens == 4 * 23


@pytest.mark.slow
def test_under_slot_pressure_preempted_requests_resume_from_their_saved_state(exported):
    ours, hf = exported
    eng = engine(ours, max_batch_size=2, max_step_tokens=6)  # prompts in chunks of at most 6 tokens
    batch = prompts(5, 9, shared=8, seed=2)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    outs = eng.generate(batch, params)
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 40) for p in batch]
    stats = eng.stats
    assert stats.preemptions > 0
    assert stats.prefill_tokens + stats.cached_tokens == sum(map(len, batch))  # nothing computed twice
    assert stats.decode_tokens == 5 * 39


def test_state_bytes_are_the_same_after_10_and_2000_tokens_of_context(exported):
    ours, _ = exported
    eng = engine(ours, max_step_tokens=512, prefix_cache=False)  # no snapshots: a forward per chunk
    figures = []
    for length in (10, 2000):
        rid = eng.add_request(prompts(1, length, seed=length)[0], SamplingParams(max_tokens=4, ignore_eos=True))
        while not any(d.token_ids for d in eng.step() if d.request_id == rid):
            pass  # prefill in chunks of 512 until the first token
        usage = eng.usage()
        figures.append((usage.slots_in_use, usage.in_use, usage.held_states, usage.bytes_in_use))
        eng.abort(rid)
    assert figures[0] == figures[1] == (1, 0, 0, usage.state_bytes)
    assert usage.state_bytes == 2 * 32 * (2 * 4 + 3 * 4)  # layers x hidden x (two shifts, aa, bb, pp)


def test_chunked_prefill_equals_one_forward_over_the_prompt(exported):
    ours, _ = exported
    prompt = prompts(1, 70, seed=3)[0]
    eng = engine(ours, max_step_tokens=16, prefix_cache=False)
    out = eng.generate([prompt], SamplingParams(max_tokens=1, logprobs=True, temperature=0.0))[0]
    assert eng.stats.steps == 5  # ceil(70 / 16) chunks, the last one sampled
    with torch.no_grad():
        logits = ours(torch.tensor([prompt])).logits[0, -1].float()
    assert out.token_ids == [int(logits.argmax())]
    assert out.logprobs[0] == pytest.approx(float(logits.log_softmax(-1).max()), abs=1e-4)


def test_snapshots_are_evicted_lru_under_pressure_and_dropped_when_weights_change(exported):
    ours, hf = exported
    eng = engine(ours, max_total_tokens=40)  # 5 snapshots of 8 tokens, the context bounded at 40
    first, second = prompts(2, 25, seed=4)  # 3 snapshots each: after 8, 16 and 24 tokens
    for p in (first, second):
        assert eng.generate([p], GREEDY)[0].token_ids == hf_greedy(hf, p, 12)
    # the tree holds first as three nodes (one per boundary, inserted as made): one leaf made room
    assert eng.stats.evicted_pages == 1 and eng.usage().evictable == 5
    assert eng.generate([second], GREEDY)[0].cached_tokens == 24
    assert eng.generate([first], GREEDY)[0].cached_tokens == 16  # its last snapshot was the one evicted
    assert eng.stats.evicted_pages == 2  # second's last, the least recently used leaf, for first's again
    eng.weights_changed()
    assert eng.usage().evictable == 0
    assert eng.generate([first], GREEDY)[0].cached_tokens == 0


def test_n_samples_logprobs_and_stop_ids_go_through_the_shared_sampler(exported):
    ours, hf = exported
    prompt = prompts(1, 12, seed=5)[0]
    want = hf_greedy(hf, prompt, 12)
    eng = engine(ours, max_batch_size=2)  # n=3 needs 3 slots: refused as for attention
    with pytest.raises(Exception, match="max_batch_size"):
        eng.generate([prompt], SamplingParams(n=3))
    eng = engine(ours, max_batch_size=4)
    outs = eng.generate([prompt], SamplingParams(n=3, max_tokens=12, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outs] == [want] * 3
    stop = eng.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[want[4]],
                                                 logprobs=True, top_logprobs=2))[0]
    assert stop.finish_reason == "stop" and stop.token_ids == want[: want.index(want[4]) + 1]
    assert len(stop.logprobs) == len(stop.top_logprobs) == len(stop.token_ids)
    sampled = [eng.generate([prompt], SamplingParams(max_tokens=8, temperature=1.0, seed=7))[0].token_ids
               for _ in range(2)]
    assert sampled[0] == sampled[1]


def test_session_turns_keep_the_state_instead_of_pages(exported):
    ours, hf = exported
    eng = engine(ours)
    first, more = prompts(1, 10, seed=6)[0], [5, 6, 7]
    chat = eng.session()
    a = chat.generate(first, GREEDY)
    assert a.token_ids == hf_greedy(hf, first, 12)
    branch = chat.fork()
    b = chat.generate(more, GREEDY)
    assert b.token_ids == hf_greedy(hf, first + a.token_ids + more, 12)
    assert b.cached_tokens == len(first) + 11  # the history's state was kept, the last reply token is new
    assert branch.generate(more, GREEDY).token_ids == b.token_ids
    memory = chat.memory()  # one held state, whatever the length
    assert (memory.tokens, memory.cached_tokens) == (len(first) + 12 + len(more) + 12, len(first) + 12 + 14)
    assert (memory.pages, memory.shared_pages, memory.bytes) == (1, 0, eng.usage().state_bytes)
    chat.close()
    branch.close()
    assert eng.usage().held_states == 0


def test_the_engine_state_continues_as_the_model_state(exported):
    """A prefill-only request leaves nothing behind, and the engine's logits equal the model's own."""
    ours, _ = exported
    prompt = prompts(1, 30, seed=8)[0]
    out = engine(ours).generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
    with torch.no_grad():
        logits = ours(torch.tensor([prompt]), cache=RwkvState()).logits[0].float().log_softmax(-1)
    want = [float(logits[i, prompt[i + 1]]) for i in range(len(prompt) - 1)]
    got = [lp[0] for lp in out.prompt_logprobs[1:]]
    assert got == pytest.approx(want, abs=1e-4)


def test_a_failed_sample_fails_only_its_request_and_the_others_states_stay_exact(exported, monkeypatch):
    """The sampler raising after the forward: the step is run again request by request, from the states
    the slots held before it (those of prompts in mid-prefill put back), and only the poisoned one fails."""
    import astrai_pl.inference.engine as engine_module

    ours, _ = exported
    batch = prompts(3, 20, shared=8, seed=9)
    poison = [7] * 5
    real = engine_module.sample

    def failing_sample(logits, params, contexts, *rest):
        if any(c[:5] == poison for c in contexts):
            raise RuntimeError("injected sampler failure")
        return real(logits, params, contexts, *rest)

    want = engine(ours).generate(batch, GREEDY)
    eng = engine(ours, max_step_tokens=24)  # the long prompts are mid-prefill when the poisoned one samples
    monkeypatch.setattr(engine_module, "sample", failing_sample)
    handles = [eng.submit(p, GREEDY) for p in [poison + [9, 10], *batch]]
    with pytest.raises(Exception, match="injected sampler failure"):
        handles[0].result()
    assert [h.result()[0].token_ids for h in handles[1:]] == [o.token_ids for o in want]
    assert eng.usage().slots_in_use == 0


def test_a_saved_engine_session_reloads_and_continues_with_the_same_tokens(exported, tmp_path):
    ours, hf = exported
    first, more = prompts(1, 10, seed=10)[0], [5, 6, 7]
    chat = engine(ours).session()
    a = chat.generate(first, GREEDY)
    chat.save(path := tmp_path / "chat.safetensors")
    chat.append([9])  # every token computed: the file keeps the state after it and its logits
    chat.save(full := tmp_path / "full.safetensors")
    fresh = engine(ours)
    fresh.generate([chat.tokens[:17]], SamplingParams(max_tokens=1))  # snapshots after 8 and 16 of them
    loaded = fresh.load_session(path)
    assert (loaded.tokens, loaded.num_computed) == (chat.tokens[:-1], len(first) + 11)
    b = loaded.generate(more, GREEDY)
    assert b.token_ids == hf_greedy(hf, first + a.token_ids + more, 12)
    assert b.cached_tokens == len(first) + 11  # continued from the file's state, nothing recomputed
    assert fresh.pool.radix.match(loaded.tokens)[1] == 16  # no snapshot at 24: a file's state is untrusted
    c = fresh.load_session(full).generate([], GREEDY)
    assert c.token_ids == hf_greedy(hf, first + a.token_ids + [9], 12) and c.cached_tokens == len(first) + 13
    loaded.close()
    assert fresh.usage().held_states == 1  # the second loaded session's state


def test_an_expired_engine_session_saves_its_tokens_and_recomputes_them_on_reload(exported, tmp_path):
    ours, hf = exported
    first = prompts(1, 10, seed=11)[0]
    eng = engine(ours)
    chat = eng.session()
    a = chat.generate(first, GREEDY)
    chat.expire()
    chat.save(path := tmp_path / "expired.safetensors")
    b = engine(ours).load_session(path).generate([4], GREEDY)
    assert b.token_ids == hf_greedy(hf, first + a.token_ids + [4], 12) and b.cached_tokens == 0


def test_a_foreign_or_edited_state_file_is_refused_by_an_engine_session(exported, tmp_path):
    ours, _ = exported
    eng = engine(ours)
    chat = eng.session()
    chat.generate(prompts(1, 6, seed=12)[0], GREEDY)
    chat.save(path := tmp_path / "chat.safetensors")
    other = Transformer(ModelConfig.from_name("rwkv-debug", hidden_size=32, intermediate_size=128)).eval()
    with pytest.raises(SessionError, match="different model"):
        engine(other).load_session(path)
    StateSession.warm(ours, [3, 4, 5]).save(bare := tmp_path / "bare.safetensors")
    with pytest.raises(SessionError, match="without token ids.*StateSession.load"):
        eng.load_session(bare)
    assert StateSession.load(path, ours).num_tokens == chat.num_computed  # a state session reads it too
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
    tensors = load_file(path)
    tensors["token_ids"][0] = 10**6
    save_file(tensors, bad := tmp_path / "bad.safetensors", metadata=metadata)
    with pytest.raises(SessionError, match="outside the vocabulary"):
        eng.load_session(bad)
    tensors = load_file(path)
    tensors["token_ids"] = tensors["token_ids"][:3]
    save_file(tensors, short := tmp_path / "short.safetensors", metadata=metadata)
    with pytest.raises(SessionError, match="token_ids"):
        eng.load_session(short)
    assert eng.usage().held_states == 1  # only chat's: a refused file takes nothing


def test_engine_sessions_on_rwkv_point_blending_and_editing_to_state_sessions(exported):
    chat = engine(exported[0]).session()
    with pytest.raises(SessionError, match="RWKV state in the engine's pool.*StateSession.blend"):
        chat.blend(chat, 0.5)
    with pytest.raises(SessionError, match="RWKV state in the engine's pool.*StateSession.scale"):
        chat.scale("aa", 0.5)


def test_a_snapshot_is_found_only_under_the_salt_it_was_cached_with(exported):
    ours, hf = exported
    eng = engine(ours)
    [prompt] = prompts(1, 20, seed=7)  # snapshots after 8 and 16 tokens
    salted = {name: dataclasses.replace(GREEDY, cache_salt=name) for name in ("alice", "bob")}
    first = eng.generate([prompt], salted["alice"])[0]
    assert first.cached_tokens == 0 and first.token_ids == hf_greedy(hf, prompt, 12)
    assert eng.generate([prompt], salted["bob"])[0].cached_tokens == 0  # another salt: nothing to learn
    assert eng.generate([prompt], GREEDY)[0].cached_tokens == 0  # no salt is a salt of its own
    again = eng.generate([prompt], salted["alice"])[0]
    assert again.cached_tokens == 16 and again.token_ids == first.token_ids  # within one salt, shared as before
    assert eng.generate([prompt], salted["bob"])[0].cached_tokens == 16  # bob's own snapshots, made above
    eng.reset_prefix_cache()
    assert list(eng.pool.radix.roots) == [None]  # every salt's snapshots evicted and their trees forgotten
