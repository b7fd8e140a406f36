"""Gemma 2 and Gemma 3 (text): logits equal transformers' both ways, the engine decodes as transformers does,
and what the decoder cannot do is refused by name."""

import json

import pytest
import torch
from family_parity import edit_json, greedy_pair, hf_random, perturbed, round_trip_gaps

from astrai_pl.inference import Engine, SamplingParams
from astrai_pl.model import ModelConfig, Transformer
from astrai_pl.model.hf import ExportError, UnsupportedCheckpointError
from astrai_pl.ops import cpu as cpu_ops

transformers = pytest.importorskip("transformers")

SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=64, sliding_window=5,
             query_pre_attn_scalar=24)


def gemma2_config(**extra):
    return transformers.Gemma2Config(**SHAPE, attn_logit_softcapping=5.0, final_logit_softcapping=3.0, **extra)


def gemma3_config(**extra):
    fields = dict(sliding_window_pattern=3, rope_theta=1e6, rope_local_base_freq=1e4,
                  rope_scaling={"rope_type": "linear", "factor": 2.0})
    return transformers.Gemma3TextConfig(**{**SHAPE, **fields, **extra})


@pytest.mark.parametrize("make", [gemma2_config, gemma3_config], ids=["gemma2", "gemma3_text"])
def test_logits_equal_transformers_both_ways(make, tmp_path):
    there, back, written = round_trip_gaps(transformers, make(), tmp_path, seq_len=20)  # 4x the window
    assert there <= 1e-4 and back <= 1e-4
    assert written["layer_types"] == make().layer_types


def test_each_feature_changes_the_logits():
    """Soft-capping, the window, the score scale and the local RoPE base each matter at this length, so the
    parity above checks every one of them."""
    torch.manual_seed(0)
    base = perturbed(Transformer(ModelConfig.from_name("gemma3-debug", attn_logit_softcapping=None)))
    ids = torch.randint(0, 320, (1, 20))
    with torch.no_grad():
        ref = base(ids).logits
        for change in (dict(sliding_window=None), dict(query_pre_attn_scalar=None), dict(rope_local_base_freq=None),
                       dict(final_logit_softcapping=2.0), dict(attn_logit_softcapping=1.0)):
            other = Transformer(ModelConfig(**{**base.config.to_dict(), **change})).eval()
            other.load_state_dict(base.state_dict())
            assert (other(ids).logits - ref).abs().max() > 1e-3, change


@pytest.mark.parametrize("make", [pytest.param(gemma2_config, marks=pytest.mark.slow), gemma3_config],
                         ids=["gemma2", "gemma3_text"])
def test_engine_greedy_equals_transformers_generate(make, tmp_path):
    prompts = [[3, 17, 90, 5], list(range(10, 22)), [7] * 9]  # shorter and longer than the window
    expected, got = greedy_pair(transformers, make(), tmp_path, prompts, max_tokens=8)
    assert got == expected
    model = Transformer.from_pretrained(tmp_path / "hf").eval()
    for kernels in (False, True):  # the CPU decode kernel (window, soft-cap, scale) and the SDPA path
        with cpu_ops.override_available(kernels):
            engine = Engine(model, max_total_tokens=512, page_size=1)
            out = engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        assert [c.token_ids for c in out] == expected, kernels


@pytest.mark.parametrize("name", ["gemma2-debug", "gemma3-debug"])
def test_presets_build_and_count_their_parameters(name):
    model = Transformer(ModelConfig.from_name(name))
    assert model.config.num_parameters() == sum(p.numel() for p in model.parameters())
    logits = model(torch.randint(0, 320, (1, 12))).logits
    if model.config.final_logit_softcapping:
        assert logits.abs().max() < model.config.final_logit_softcapping


def test_training_loss_sees_the_capped_logits():
    from astrai_pl.objectives import Pretrain

    torch.manual_seed(0)
    module = Pretrain(arch=ModelConfig.from_name("gemma2-debug", final_logit_softcapping=0.5))
    ids = torch.randint(0, 320, (2, 12))
    loss, _ = module.next_token_loss({"input_ids": ids, "labels": ids})
    logits = module.model(ids).logits
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 320), ids[:, 1:].reshape(-1))
    assert torch.allclose(loss, expected, atol=1e-5)


@pytest.mark.parametrize("key, value, make", [
    ("use_bidirectional_attention", True, gemma3_config),
    ("attention_bias", True, gemma2_config),
    ("attn_logit_softcapping", 20.0, gemma3_config),
    ("hidden_activation", "gelu", gemma2_config),
])
def test_unsupported_fields_are_refused_by_name(key, value, make, tmp_path):
    hf_random(transformers, make()).save_pretrained(tmp_path)
    edit_json(tmp_path / "config.json", lambda raw: raw.update({key: value}))
    with pytest.raises(UnsupportedCheckpointError, match=key.replace("hidden_activation", "hidden_act")):
        Transformer.from_pretrained(tmp_path)


def test_multimodal_gemma3_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3", "text_config": {}}))
    with pytest.raises(UnsupportedCheckpointError, match="model_type"):
        Transformer.from_pretrained(tmp_path)


def test_fields_other_families_lack_are_not_exported(tmp_path):
    model = Transformer(ModelConfig.from_name("debug", model_type="llama", attn_logit_softcapping=30.0))
    with pytest.raises(ExportError, match="attn_logit_softcapping"):
        model.save_pretrained(tmp_path)
