"""OLMo 2: norms on the outputs of attention and of the MLP, q/k norms over the whole projected width; logits equal
to transformers' both ways and the engine's greedy decoding equal to transformers' generate."""

import pytest
import torch
from family_parity import VOCAB, edit_json, greedy_pair, hf_random, round_trip_gaps

from astrai_pl.model import ConfigError, ModelConfig, Transformer
from astrai_pl.model.hf import ExportError, UnsupportedCheckpointError

transformers = pytest.importorskip("transformers")

SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def olmo2_config(**fields):
    return transformers.Olmo2Config(**{**SHAPE, **fields})


@pytest.mark.parametrize("rope", [None, {"rope_type": "linear", "factor": 2.0}], ids=["plain", "linear"])
def test_parity_both_ways(tmp_path, rope):
    there, back, config = round_trip_gaps(transformers, olmo2_config(rope_scaling=rope), tmp_path)
    assert there <= 1e-4 and back <= 1e-4, (there, back)
    assert config["architectures"] == ["Olmo2ForCausalLM"]


def test_blocks_normalise_outputs_and_qk_norms_span_all_heads():
    model = Transformer(ModelConfig.from_name("olmo2-debug"))
    block = model.layers[0]
    assert not hasattr(block, "input_layernorm")
    assert block.post_attention_layernorm.weight.shape == block.post_feedforward_layernorm.weight.shape == (64,)
    assert block.self_attn.q_norm.weight.shape == (4 * 16,) and block.self_attn.k_norm.weight.shape == (2 * 16,)
    # one RMS over all heads: scaling one head's query rows changes the other heads' normed queries
    x = torch.randn(1, 3, 64)
    q_before = block.self_attn.q_norm(block.self_attn.q_proj(x))
    with torch.no_grad():
        block.self_attn.q_proj.weight[:16] *= 3
    q_after = block.self_attn.q_norm(block.self_attn.q_proj(x))
    assert not torch.allclose(q_before[..., 16:], q_after[..., 16:])


def test_engine_greedy_equals_transformers_generate(tmp_path):
    prompts = [[int(t) for t in torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(n))]
               for n in (4, 11, 19)]
    expected, got = greedy_pair(transformers, olmo2_config(), tmp_path, prompts, max_tokens=6)
    assert got == expected


@pytest.mark.parametrize("key,value", [("attention_bias", True), ("attention_dropout", 0.1), ("sliding_window", 8),
                                       ("partial_rotary_factor", 0.5)])
def test_unsupported_fields_are_refused_by_name(tmp_path, key, value):
    hf_random(transformers, olmo2_config()).save_pretrained(tmp_path)
    edit_json(tmp_path / "config.json", lambda raw: raw.update({key: value}))
    with pytest.raises(UnsupportedCheckpointError, match=key):
        Transformer.from_pretrained(tmp_path)


def test_what_olmo2_cannot_hold_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="num_experts"):
        ModelConfig.from_name("olmo2-debug", num_experts=4)
    with pytest.raises(ExportError, match="qk_norm"):
        Transformer(ModelConfig.from_name("olmo2-debug", qk_norm=False)).save_pretrained(tmp_path / "a")
    with pytest.raises(ExportError, match="sliding_window"):
        Transformer(ModelConfig.from_name("olmo2-debug", sliding_window=8)).save_pretrained(tmp_path / "b")


def test_preset_round_trips(tmp_path):
    model = Transformer(ModelConfig.from_name("olmo2-debug")).eval()
    model.save_pretrained(tmp_path)
    ids = torch.randint(0, 320, (2, 12))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, Transformer.from_pretrained(tmp_path).eval()(ids).logits)
