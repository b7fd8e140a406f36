"""RWKV sessions: zero, warm and shared states, turns computing only new tokens, blending, editing, batches
over independent states, inspect / distance, files with compression, and the store with its expiry."""

import math

import pytest
import torch

from astrai_pl.inference import (
    CapacityError,
    SamplingParams,
    SessionError,
    StateSession,
    StateStore,
    generate_batch,
)
from astrai_pl.inference.recurrent.files import compressible
from astrai_pl.inference.recurrent.ops import unscaled
from astrai_pl.model import ModelConfig, Transformer

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def rwkv_model(seed=0) -> Transformer:
    """rwkv-debug with its weights jittered, so greedy output depends on the context."""
    torch.manual_seed(seed)
    model = Transformer(ModelConfig.from_name("rwkv-debug"))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    return model.eval()


@pytest.fixture(scope="module")
def rwkv():
    return rwkv_model(0)


def ids(n, seed=0):
    return torch.randint(3, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def greedy_reference(model, tokens, steps):
    """Greedy decoding by running the whole sequence from a zero state at every step."""
    tokens, out = list(tokens), []
    with torch.no_grad():
        for _ in range(steps):
            out.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
            tokens.append(out[-1])
    return out


def same_state(x, y, exact=True):
    for lx, ly in zip(x, y):
        for a, b in zip(lx, ly):
            assert torch.equal(a, b) if exact else torch.allclose(a, b, rtol=1e-5, atol=1e-5)


# -- zero, warm and shared states ---------------------------------------------------------------------------
def test_turns_continue_the_state_and_compute_only_new_tokens(rwkv):
    context, q1, q2 = ids(9, 1), ids(4, 2), ids(3, 3)
    chat = StateSession.warm(rwkv, context)
    assert chat.num_tokens == chat.computed_tokens == 9
    first = chat.generate(q1, GREEDY)
    assert first.token_ids == greedy_reference(rwkv, context + q1, 6)
    assert chat.computed_tokens == 9 + 4 + 5 and chat.pending == first.token_ids[-1:]  # last reply token pending
    second = chat.generate(q2, GREEDY)
    assert second.token_ids == greedy_reference(rwkv, context + q1 + first.token_ids + q2, 6)
    assert chat.computed_tokens == 18 + 1 + 3 + 5 and chat.num_tokens == 9 + 4 + 6 + 3 + 6


def test_a_zero_state_session_is_the_model_from_scratch(rwkv):
    chat = StateSession(rwkv)
    assert not chat.state.layers  # nothing allocated until a token comes
    prompt = ids(5, 4)
    assert chat.generate(prompt, GREEDY).token_ids == greedy_reference(rwkv, prompt, 6)
    with pytest.raises(SessionError, match="pass a prompt"):
        StateSession(rwkv).generate([], GREEDY)


def test_forks_share_the_warm_state_until_they_change(rwkv):
    warm = StateSession.warm(rwkv, ids(12, 5))
    before = [tuple(t.clone() for t in layer) for layer in warm.state.layers]
    a, b = warm.fork(), warm.fork()
    assert all(x is y for la, lb in zip(a.state.layers, warm.state.layers) for x, y in zip(la, lb))  # no copy
    out_a, out_b = a.generate(ids(3, 6), GREEDY), b.generate(ids(3, 7), GREEDY)
    b.scale("history", 0.1)
    same_state(warm.state.layers, before)  # the shared state was never written
    assert out_a.token_ids == warm.fork().generate(ids(3, 6), GREEDY).token_ids
    assert out_b.token_ids != out_a.token_ids
    assert not torch.equal(a.layers()[0].aa, warm.layers()[0].aa)


def test_only_rwkv_models_and_one_continuation(rwkv, model):
    with pytest.raises(SessionError, match="recurrent"):
        StateSession(model)
    with pytest.raises(SessionError, match="n=2"):
        StateSession.warm(rwkv, ids(3)).generate([5], SamplingParams(n=2))


# -- batches ------------------------------------------------------------------------------------------------
def test_a_batch_of_independent_states_equals_each_alone(rwkv):
    warm = StateSession.warm(rwkv, ids(8, 8))
    starts = [warm.fork(), StateSession(rwkv), StateSession.warm(rwkv, ids(5, 9))]
    prompts = [ids(3, 10), ids(3, 11), ids(6, 12)]
    stop = greedy_reference(rwkv, prompts[1], 3)[-1]  # the zero-state session stops by 3 tokens, not 9
    params = [GREEDY, SamplingParams(max_tokens=9, temperature=0, ignore_eos=True, stop_token_ids=[stop]),
              SamplingParams(max_tokens=4, temperature=0.8, seed=3)]
    alone = [s.fork() for s in starts]
    singles = [s.generate(p, q) for s, p, q in zip(alone, prompts, params)]
    batched = generate_batch(starts, prompts, params)
    assert [c.token_ids for c in batched] == [c.token_ids for c in singles]
    assert [c.finish_reason for c in batched] == [c.finish_reason for c in singles]
    assert len(batched[2].token_ids) == 4 and batched[1].finish_reason == "stop" and len(batched[1].token_ids) <= 3
    for x, y in zip(starts, alone):
        same_state(x.state.layers, y.state.layers, exact=False)
        assert x.pending == y.pending and x.num_tokens == y.num_tokens


def test_a_failed_batch_changes_no_session(rwkv):
    a, b = StateSession.warm(rwkv, ids(4)), StateSession.warm(rwkv, ids(4, 1))
    layers = list(a.state.layers)
    with pytest.raises(Exception, match="vocabulary"):
        generate_batch([a, b], [[5, 6], [999]], GREEDY)
    assert a.state.layers == layers and a.num_tokens == 4
    with pytest.raises(SessionError, match="same session twice"):
        generate_batch([a, a], [[5], [6]], GREEDY)


# -- blending -----------------------------------------------------------------------------------------------
def test_blend_endpoints_are_each_state_exactly(rwkv):
    x, y = StateSession.warm(rwkv, ids(10, 13)), StateSession.warm(rwkv, ids(30, 14))
    same_state(x.blend(y, 0).layers(), x.layers())
    same_state(x.blend(y, 1).layers(), y.layers())
    same_state(x.blend(StateSession(rwkv), 0.0).layers(), x.layers())


def test_blend_interpolates_the_unscaled_sums(rwkv):
    x, y = StateSession.warm(rwkv, ids(10, 15)), StateSession.warm(rwkv, ids(20, 16))
    y.scale("history", 1e200)  # exponents e^460 apart: a naive a·e^pp would overflow float32
    alpha = 0.3
    mix = x.blend(y, alpha)
    for lm, lx, ly in zip(mix.layers(), x.layers(), y.layers()):
        assert all(torch.isfinite(t).all() for t in lm)
        for um, ux, uy in zip(unscaled(lm), unscaled(lx), unscaled(ly)):
            torch.testing.assert_close(um, (1 - alpha) * ux + alpha * uy, rtol=1e-5, atol=0)
        torch.testing.assert_close(lm.att_shift, torch.lerp(lx.att_shift, ly.att_shift, alpha))
    assert mix.last_logits is None and math.isfinite(float(mix.generate([7], GREEDY).token_ids[0]))
    with pytest.raises(ValueError, match="alpha=1.5"):
        x.blend(y, 1.5)
    with pytest.raises(SessionError, match="another model"):
        x.blend(StateSession.warm(rwkv_model(1), [4]), 0.5)


def test_attention_sessions_refuse_blending(model, make_engine):
    engine = make_engine(model)
    chat = engine.session()
    with pytest.raises(SessionError, match="no state to interpolate"):
        chat.blend(engine.session(), 0.5)
    with pytest.raises(SessionError, match="StateSession.scale"):
        chat.scale("history", 0.5)


# -- editing ------------------------------------------------------------------------------------------------
def test_scale_touches_only_the_chosen_component_and_layers(rwkv):
    chat = StateSession.warm(rwkv, ids(10, 17))
    before = chat.layers()
    chat.scale("ffn_shift", 0.0, layers=[1])
    after = chat.layers()
    assert after[0] is before[0] and torch.equal(after[1].att_shift, before[1].att_shift)
    assert not after[1].ffn_shift.any() and chat.last_logits is None
    faded = StateSession.warm(rwkv, ids(10, 17)).scale("history", 0.25)
    by_parts = StateSession.warm(rwkv, ids(10, 17)).scale("aa", 0.25).scale("bb", 0.25)
    for lf, lp, lb in zip(faded.layers(), by_parts.layers(), before):
        for uf, up, ub in zip(unscaled(lf), unscaled(lp), unscaled(lb)):
            torch.testing.assert_close(uf, 0.25 * ub, rtol=1e-5, atol=0)
            torch.testing.assert_close(uf, up, rtol=1e-5, atol=0)
    emptied = StateSession.warm(rwkv, ids(10, 17)).scale("history", 0)
    assert not emptied.layers()[0].bb.any()


@pytest.mark.parametrize("args, match", [(("att", 2.0), "component='att'"), (("bb", -1.0), "factor >= 0"),
                                         (("aa", float("nan")), "finite"), (("aa", 2.0, [2]), "layers 0..1")])
def test_scale_refuses_what_is_no_edit(rwkv, args, match):
    with pytest.raises(ValueError, match=match):
        StateSession.warm(rwkv, [5]).scale(*args)


# -- inspect and distance -----------------------------------------------------------------------------------
def test_inspect_reports_the_unscaled_magnitudes(rwkv):
    chat = StateSession.warm(rwkv, ids(15, 18))
    report = chat.inspect()
    assert [(r.layer, r.component) for r in report.rows][:4] == [
        (0, "ffn_shift"), (0, "att_shift"), (0, "numerator"), (0, "denominator")]
    layer = chat.layers()[1]
    a = (layer.aa.double() * layer.pp.double().exp()).abs()
    row = report.rows[6]
    assert row.component == "numerator" and row.layer == 1
    assert math.isclose(row.mean_abs, float(a.mean()), rel_tol=1e-9) and math.isclose(row.max_abs, float(a.max()))
    assert "denominator" in report.table()


def test_distance_is_zero_to_itself_and_symmetric(rwkv):
    x, y = StateSession.warm(rwkv, ids(15, 19)), StateSession.warm(rwkv, ids(15, 20))
    assert all(r.l2 == 0 and r.cosine == pytest.approx(1.0) for r in x.distance(x.fork()).rows)
    xy, yx = x.distance(y).rows, y.distance(x).rows
    assert [r.l2 for r in xy] == pytest.approx([r.l2 for r in yx])
    lx, ly = x.layers()[0], y.layers()[0]
    expected = float((unscaled(lx)[0] - unscaled(ly)[0]).norm())
    assert xy[2].component == "numerator" and xy[2].l2 == pytest.approx(expected, rel=1e-9)
    assert -1 <= xy[2].cosine < 1


# -- files --------------------------------------------------------------------------------------------------
def test_float32_files_round_trip_bit_for_bit(rwkv, tmp_path):
    chat = StateSession.warm(rwkv, ids(20, 21))
    chat.generate(ids(3, 22), GREEDY)
    chat.save(tmp_path / "chat.safetensors")
    assert not chat.pending  # saving computed the pending reply token
    loaded = StateSession.load(tmp_path / "chat.safetensors", rwkv)
    same_state(loaded.layers(), chat.layers())
    assert loaded.num_tokens == chat.num_tokens and torch.equal(loaded.last_logits, chat.last_logits)
    assert loaded.generate([], GREEDY).token_ids == chat.generate([], GREEDY).token_ids


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_compressed_files_keep_the_logits_close_and_the_size_fixed(rwkv, tmp_path, dtype):
    short, long = StateSession.warm(rwkv, ids(10, 23)), StateSession.warm(rwkv, ids(2000, 24))
    sizes = []
    for name, chat in (("short", short), ("long", long)):
        chat.save(tmp_path / name, dtype=dtype)
        sizes.append((tmp_path / name).stat().st_size)
        loaded = StateSession.load(tmp_path / name, rwkv)
        probe = ids(8, 25)
        with torch.no_grad():
            want = rwkv(torch.tensor([probe]), cache=chat.fork().state).logits
            got = rwkv(torch.tensor([probe]), cache=loaded.state).logits
        assert (want - got).abs().max() < (0.02 if dtype == torch.float16 else 0.1)
    assert sizes[0] == sizes[1]


def test_compression_renormalises_so_large_sums_fit_float16(rwkv, tmp_path):
    chat = StateSession.warm(rwkv, ids(10, 26)).scale("aa", 1e6).scale("bb", 1e6)  # a / b unchanged
    assert chat.layers()[0].bb.max() > 65504  # float16's largest
    chat.save(tmp_path / "big", dtype=torch.float16)
    loaded = StateSession.load(tmp_path / "big", rwkv)
    for ll, lc in zip(loaded.layers(), chat.layers()):
        assert torch.allclose(ll.bb, torch.ones_like(ll.bb))
        for ul, uc in zip(unscaled(ll), unscaled(lc)):
            torch.testing.assert_close(ul, uc, rtol=2e-3, atol=0)
    assert torch.equal(compressible(compressible(chat.layers()[0])).bb, compressible(chat.layers()[0]).bb)


# -- the store ----------------------------------------------------------------------------------------------
def test_the_store_expires_by_its_clock_and_caps_the_count(rwkv):
    store = StateStore(rwkv, ttl=10, max_sessions=2, clock=lambda: 0.0)
    alice = store.start("alice", ids(4), now=0.0)
    store.start("bob", now=0.0)
    assert store.get("alice", now=8.0) is alice  # used at 8: alive until 18
    with pytest.raises(CapacityError, match="max_sessions=2"):
        store.start("carol", now=9.0)
    store.start("carol", now=10.0)  # bob (last used at 0) expired and made room
    assert "bob" not in store and store.get("bob", now=10.0) is None
    assert store.get("alice", now=17.9) is alice and store.get("alice", now=27.9) is None
    assert store.sweep(now=20.0) == ["carol"] and len(store) == 0


def test_the_store_checks_its_settings_and_keeps_its_model(rwkv):
    with pytest.raises(ValueError, match="ttl=0"):
        StateStore(rwkv, ttl=0)
    with pytest.raises(ValueError, match="max_sessions=0"):
        StateStore(rwkv, max_sessions=0)
    with pytest.raises(SessionError, match="its own model"):
        StateStore(rwkv).put("x", StateSession(rwkv_model(1)))
