"""The RWKV-4 mixer: the recurrence against a float64 reference, packed documents, the recurrent state, and parity
with transformers' RwkvForCausalLM (logits and state) both ways."""

import json

import pytest
import torch

from astrai_pl.model import ConfigError, ModelConfig, Transformer
from astrai_pl.model.hf import CheckpointError, UnsupportedCheckpointError
from astrai_pl.model.rwkv import (
    LayerState,
    RwkvState,
    UnsupportedMixerError,
    check_engine_support,
    wkv,
    wkv_reference,
)


def _inputs(B=2, T=9, H=8, k_scale=3.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = -torch.exp(torch.randn(H, generator=gen))
    u = torch.randn(H, generator=gen)
    k = torch.randn(B, T, H, generator=gen) * k_scale
    v = torch.randn(B, T, H, generator=gen)
    return w, u, k, v


def _real(state):
    """(a, b): the unscaled sums of a (aa, bb, pp) state."""
    aa, bb, pp = (s.double() for s in state)
    return aa * pp.exp(), bb * pp.exp()


# -- the recurrence ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(1, 1, 4), (2, 9, 8), (3, 17, 5)])
def test_wkv_equals_the_float64_recurrence(shape):
    w, u, k, v = _inputs(*shape)
    out, state = wkv(w, u, k, v)
    ref, ref_state = wkv_reference(w, u, k, v)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    for ours, theirs in zip(_real(state), ref_state[:2]):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_wkv_continues_from_a_state():
    w, u, k, v = _inputs(T=12)
    full, full_state = wkv(w, u, k, v)
    head, state = wkv(w, u, k[:, :5], v[:, :5])
    tail, tail_state = wkv(w, u, k[:, 5:], v[:, 5:], state)
    torch.testing.assert_close(torch.cat([head, tail], 1), full)
    ref, _ = wkv_reference(w, u, k[:, 5:], v[:, 5:], state)
    torch.testing.assert_close(tail.double(), ref, rtol=1e-5, atol=1e-5)
    for ours, theirs in zip(tail_state, full_state):
        torch.testing.assert_close(ours, theirs)


def test_wkv_is_stable_where_the_plain_sums_overflow_float32():
    w, u, k, v = _inputs(T=16, k_scale=1.0)
    k = k + 90.0
    assert not torch.isfinite(torch.exp(k)).all()  # the unscaled sums would be inf / inf in float32
    out, state = wkv(w, u, k, v)
    ref, ref_state = wkv_reference(w, u, k, v)  # float64 holds e^{90}
    assert torch.isfinite(out).all() and all(torch.isfinite(s).all() for s in state)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(_real(state)[1], ref_state[1], rtol=1e-4, atol=0.0)  # pp ~ 90: float32 ulp


def test_wkv_resets_equal_separate_runs():
    w, u, k, v = _inputs(B=2, T=10)
    resets = torch.zeros(2, 10, dtype=torch.bool)
    resets[0, 4] = resets[1, 7] = True
    out, _ = wkv(w, u, k, v, resets=resets)
    for row, cut in ((0, 4), (1, 7)):
        first, _ = wkv(w, u, k[row:row + 1, :cut], v[row:row + 1, :cut])
        second, _ = wkv(w, u, k[row:row + 1, cut:], v[row:row + 1, cut:])
        torch.testing.assert_close(out[row:row + 1], torch.cat([first, second], 1))


def test_wkv_gradients_equal_the_float64_references():
    inputs = _inputs(B=2, T=7, H=4)
    ours = [t.clone().requires_grad_() for t in inputs]
    ref = [t.double().requires_grad_() for t in inputs]
    weights = torch.randn(2, 7, 4, generator=torch.Generator().manual_seed(5))
    (wkv(*ours)[0] * weights).sum().backward()
    (wkv_reference(*ref)[0] * weights.double()).sum().backward()
    for name, a, b in zip("wukv", ours, ref):
        torch.testing.assert_close(a.grad.double(), b.grad, rtol=1e-4, atol=1e-5, msg=name)


# -- the model --------------------------------------------------------------------------------------------
def rwkv_model(preset="rwkv-debug", seed=0, **overrides) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(ModelConfig.from_name(preset, **overrides))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    return model.eval()


def test_packed_documents_do_not_see_each_other():
    model = rwkv_model()
    gen = torch.Generator().manual_seed(1)
    doc1, doc2 = torch.randint(3, 320, (7,), generator=gen), torch.randint(3, 320, (9,), generator=gen)
    other1 = torch.randint(3, 320, (7,), generator=gen)
    positions = torch.cat([torch.arange(7), torch.arange(9)])[None]
    with torch.no_grad():
        alone = model(doc2[None]).logits[0]
        packed = model(torch.cat([doc1, doc2])[None], positions).logits[0]
        changed = model(torch.cat([other1, doc2])[None], positions).logits[0]
        doc_ids = torch.tensor([[0] * 7 + [1] * 9])
        by_ids = model(torch.cat([other1, doc2])[None], document_ids=doc_ids).logits[0]
        unpacked = model(torch.cat([other1, doc2])[None]).logits[0]  # no boundary given: one document
    torch.testing.assert_close(packed[7:], changed[7:])
    torch.testing.assert_close(packed[7:], alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(by_ids, changed)
    torch.testing.assert_close(packed[:7], model(doc1[None]).logits[0].detach(), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(unpacked[7:], alone, atol=1e-3)  # the state does carry across without one


@pytest.mark.parametrize("training", [False, True])
def test_a_state_carries_a_prompt_across_calls(training):
    model = rwkv_model(rescale_every=1).train(training)
    ids = torch.randint(3, 320, (2, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(ids, cache=(whole := RwkvState())).logits
        state = RwkvState()
        parts = [model(ids[:, a:b], cache=state).logits for a, b in ((0, 4), (4, 5), (5, 11))]
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-5, atol=1e-5)
    for ours, theirs in zip(state.to_hf(), whole.to_hf()):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert len(state.layers) == 2 and isinstance(state.layers[0], LayerState)
    with pytest.raises(ValueError, match="RwkvState holds 2 layers"):  # another batch's state
        model(ids[:1], cache=state)
    with pytest.raises(ValueError, match="this model has 3 layers"):  # another model's state
        rwkv_model(num_hidden_layers=3)(ids, cache=state)


@pytest.mark.parametrize("start", [False, True])
def test_one_forward_yields_the_states_at_chosen_positions_as_forwards_over_each_prefix(start):
    model = rwkv_model(rescale_every=1).eval()
    ids = torch.randint(3, 320, (2, 13), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        before = RwkvState()
        if start:
            model(ids[:, :3], cache=before)
            ids = ids[:, 3:]

        def copy():
            return RwkvState(list(before.layers))

        plain = model(ids, cache=(whole := copy())).logits
        state = RwkvState(list(before.layers), at=(1, 4, 5, ids.shape[1]))
        marked = model(ids, cache=state).logits
        torch.testing.assert_close(marked, plain, rtol=0, atol=1e-6)
        for ours, theirs in zip(state.to_hf(), whole.to_hf()):
            torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
        assert len(state.snapshots) == 2 and state.snapshots[0].aa.shape == (2, 4, 64)
        for p, t in enumerate(state.at):
            model(ids[:, :t], cache=(prefix := copy()))
            for layer, (got, want) in enumerate(zip(state.snapshots, prefix.layers)):
                for name, g, w in zip(LayerState._fields, got, want):
                    where = f"t={t} layer {layer} {name}"
                    torch.testing.assert_close(g[:, p], w, rtol=1e-6, atol=1e-6, msg=where)
    with pytest.raises(ValueError, match="RwkvState.at"):
        model(ids, cache=RwkvState(at=(4, 2)))


def test_hidden_states_and_activation_checkpointing_keep_the_forward():
    from astrai_pl.parallel import apply_activation_checkpointing

    ids = torch.randint(3, 320, (2, 8), generator=torch.Generator().manual_seed(3))
    plain = rwkv_model().train()
    hidden, aux = plain.hidden_states(ids)
    assert aux is None and hidden.shape == (2, 8, 64)
    torch.testing.assert_close(plain.lm_head(hidden), plain(ids).logits)
    plain(ids).logits.square().mean().backward()
    for mode in ("full", "selective"):
        checkpointed = rwkv_model().train()
        apply_activation_checkpointing(checkpointed, mode)
        checkpointed(ids).logits.square().mean().backward()
        for (name, p), q in zip(plain.named_parameters(), checkpointed.parameters()):
            torch.testing.assert_close(q.grad, p.grad, msg=f"{mode}: {name}")


@pytest.mark.slow
def test_compiled_blocks_keep_the_forward():
    from astrai_pl.parallel import compile_blocks

    ids = torch.randint(3, 320, (2, 8), generator=torch.Generator().manual_seed(3))
    plain, compiled = rwkv_model().train(), rwkv_model().train()
    compile_blocks(compiled)  # the recurrence stays eager (a graph break), the projections compile
    torch.testing.assert_close(compiled(ids).logits, plain(ids).logits, rtol=1e-5, atol=1e-5)


def test_parameters_train_with_the_usual_groups():
    from astrai_pl.objectives.base import param_groups

    model = rwkv_model()
    decay, no_decay = param_groups(model)
    names = {id(p): n for n, p in model.named_parameters()}
    assert all("time_" not in names[id(p)] for p in decay["params"])  # decay, bonus and μ are 1-D: not decayed
    assert any("time_mix" in names[id(p)] for p in no_decay["params"])


@pytest.mark.parametrize("preset", ["rwkv-debug", "rwkv-tiny"])
def test_presets_count_their_parameters(preset):
    cfg = ModelConfig.from_name(preset)
    model = Transformer(cfg)
    assert cfg.mixer == "rwkv" and model.rotary is None
    assert cfg.num_parameters() == sum(p.numel() for p in model.parameters())


def test_a_few_pretraining_steps_lower_the_loss():
    from astrai_pl.objectives import Pretrain

    torch.manual_seed(0)
    module = Pretrain(arch=ModelConfig.from_name("rwkv-debug"), label_smoothing=0.0,
                      optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3))
    optimizer = module.configure_optimizers()
    pattern = torch.arange(3, 19).repeat(2)  # a repeating sequence: learnable from the previous token
    batch = {"input_ids": pattern[None].repeat(4, 1), "labels": pattern[None].repeat(4, 1)}
    with torch.no_grad():
        before, _ = module._shared_step(batch, "val")
    module.train()
    for _ in range(8):
        loss, _ = module._shared_step(batch, "train")
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        after, _ = module._shared_step(batch, "val")
    assert after < before - 0.5, (before, after)


# -- configuration ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("field,value", [("attention_bias", True), ("qk_norm", True), ("num_experts", 4),
                                         ("rope_scaling", {"rope_type": "linear", "factor": 2.0}),
                                         ("sliding_window", 128), ("layer_norm_epsilon", 0.0)])
def test_rwkv_refuses_what_it_cannot_honour(field, value):
    with pytest.raises(ConfigError, match=f"ModelConfig.{field}="):
        ModelConfig.from_name("rwkv-debug", **{field: value})


def test_attention_shape_fields_are_ignored_by_rwkv():
    cfg = ModelConfig.from_name("rwkv-debug", hidden_size=60, num_attention_heads=7)  # 7 does not divide 60
    assert Transformer(cfg)(torch.tensor([[3, 4]])).logits.shape == (1, 2, 320)
    with pytest.raises(ConfigError, match="num_attention_heads"):
        ModelConfig.from_name("debug", hidden_size=60, num_attention_heads=7)


def test_a_kv_pool_and_kv_caches_are_refused_with_a_clear_error():
    model = rwkv_model()
    with pytest.raises(UnsupportedMixerError, match="model_type='rwkv'.*K/V pool.*Fix: serve it with Engine"):
        check_engine_support(model.config)
    check_engine_support(ModelConfig.from_name("debug"))  # attention models pass
    with pytest.raises(UnsupportedMixerError, match="RwkvState"):
        model(torch.tensor([[3, 4]]), cache=object())


# -- transformers parity ----------------------------------------------------------------------------------
transformers = pytest.importorskip("transformers")

SHAPES = [  # RwkvConfig fields beyond the vocabulary
    dict(hidden_size=32, num_hidden_layers=2, intermediate_size=64, rescale_every=6),
    dict(hidden_size=48, num_hidden_layers=4, intermediate_size=96, rescale_every=2, tie_word_embeddings=True),
    dict(hidden_size=16, num_hidden_layers=3, intermediate_size=None, rescale_every=1, layer_norm_epsilon=1e-6),
]


def hf_rwkv(seed=0, **fields):
    """RwkvForCausalLM with every tensor random: its init sets time_first to ones and LayerNorms to (1, 0)."""
    torch.manual_seed(seed)
    model = transformers.RwkvForCausalLM(transformers.RwkvConfig(vocab_size=96, context_length=64, **fields))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "time_mix" in name:
                p.copy_(torch.rand(p.shape, generator=gen))  # μ in [0, 1]
            elif "time_decay" in name or "time_first" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    return model.eval()


def _ids(T=13, B=2, seed=1):
    return torch.randint(0, 96, (B, T), generator=torch.Generator().manual_seed(seed))


def hf_load(path):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model.eval()


@pytest.mark.parametrize("fields", SHAPES, ids=lambda f: f"h{f['hidden_size']}-L{f['num_hidden_layers']}")
def test_transformers_checkpoint_loads_with_the_same_logits_and_state(tmp_path, fields):
    hf = hf_rwkv(**fields)
    hf.save_pretrained(tmp_path)
    ours = Transformer.from_pretrained(tmp_path).eval()
    assert ours.config.model_type == "rwkv" and ours.config.rescale_every == fields["rescale_every"]
    ids = _ids()
    with torch.no_grad():
        theirs = hf(ids, use_cache=True)
        mine = ours(ids, cache=(state := RwkvState())).logits
    assert (mine - theirs.logits).abs().max() <= 1e-4
    for i, (a, b) in enumerate(zip(state.to_hf(), theirs.state)):
        assert a.shape == b.shape and a.dtype == b.dtype, i
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=f"state[{i}]")
    more = _ids(T=3, seed=2)  # transformers continuing from its state, we from ours
    with torch.no_grad():
        theirs_next = hf(more, state=[s.clone() for s in theirs.state], use_cache=True).logits
        mine_next = ours(more, cache=RwkvState.from_hf(theirs.state)).logits
    assert (mine_next - theirs_next).abs().max() <= 1e-4


@pytest.mark.parametrize("fields", SHAPES, ids=lambda f: f"h{f['hidden_size']}-L{f['num_hidden_layers']}")
def test_our_checkpoint_loads_in_transformers_with_the_same_logits(tmp_path, fields):
    cfg = dict(vocab_size=96, hidden_size=fields["hidden_size"], num_hidden_layers=fields["num_hidden_layers"],
               intermediate_size=fields["intermediate_size"] or 4 * fields["hidden_size"],
               rescale_every=fields["rescale_every"], tie_word_embeddings=fields.get("tie_word_embeddings", False),
               layer_norm_epsilon=fields.get("layer_norm_epsilon", 1e-5), max_position_embeddings=64)
    torch.manual_seed(0)
    ours = Transformer(ModelConfig(model_type="rwkv", **cfg))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    ours.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["architectures"] == ["RwkvForCausalLM"] and written["context_length"] == 64
    hf = hf_load(tmp_path)
    ids = _ids()
    for training in (False, True):  # eval rescales (transformers divides the weights), training does not
        ours.train(training)
        hf.train(training)
        with torch.no_grad():
            assert (ours(ids).logits - hf(ids).logits).abs().max() <= 1e-4, training
    back = Transformer.from_pretrained(tmp_path)
    for (name, a), b in zip(ours.state_dict().items(), back.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("edit,error,needle", [
    ({"attention_hidden_size": 32}, UnsupportedCheckpointError, "attention_hidden_size"),
    ({"hidden_size": None}, CheckpointError, "'hidden_size' is missing"),
    ({"layer_norm_epsilon": -1.0}, UnsupportedCheckpointError, "layer_norm_epsilon"),
    ({"rescale_every": "6"}, UnsupportedCheckpointError, "rescale_every"),
])
def test_a_bad_rwkv_config_json_is_refused_naming_the_key(tmp_path, edit, error, needle):
    hf_rwkv(hidden_size=16, num_hidden_layers=2, intermediate_size=32).save_pretrained(tmp_path)
    config = {**json.loads((tmp_path / "config.json").read_text()), **edit}
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    with pytest.raises(error, match=needle):
        Transformer.from_pretrained(tmp_path)
