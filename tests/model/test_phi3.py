"""Phi-3: fused qkv/gate_up checkpoints split on load and joined on save, LongRoPE's short and long factors,
logits equal to transformers' both ways, the engine's greedy decoding equal to transformers' generate."""

import pytest
import torch
from family_parity import VOCAB, edit_json, greedy_pair, hf_random, round_trip_gaps

from astrai_pl.model import ConfigError, ModelConfig, Transformer
from astrai_pl.model.hf import ExportError, UnsupportedCheckpointError, WeightShapeError
from astrai_pl.model.layers import sequence_lengths

transformers = pytest.importorskip("transformers")

SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.6, 3.3, 4.1],
            "long_factor": [1.0, 1.5, 2.2, 3.0, 4.5, 6.0, 8.0, 11.0]}  # head_dim 16: 8 frequencies


def phi3_config(**fields):
    return transformers.Phi3Config(**{**SHAPE, "max_position_embeddings": 64, **fields})


def longrope_config(**fields):
    """Pretrained on 16 tokens, extended to 64: sequences past 16 take the long factors."""
    return phi3_config(rope_scaling=dict(LONGROPE), original_max_position_embeddings=16, **fields)


def test_plain_rope_parity_both_ways_and_fused_keys(tmp_path):
    there, back, config = round_trip_gaps(transformers, phi3_config(), tmp_path)
    assert there <= 1e-4 and back <= 1e-4, (there, back)
    assert config["architectures"] == ["Phi3ForCausalLM"] and config["rope_scaling"] is None
    from safetensors import safe_open

    with safe_open(tmp_path / "ours" / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert "model.layers.0.self_attn.qkv_proj.weight" in keys and "model.layers.1.mlp.gate_up_proj.weight" in keys
    assert not any(k.endswith((".q_proj.weight", ".gate_proj.weight", ".up_proj.weight")) for k in keys)


@pytest.mark.parametrize("seq_len", [12, 24], ids=["short-factors", "long-factors"])
def test_longrope_parity_both_ways(tmp_path, seq_len):
    there, back, config = round_trip_gaps(transformers, longrope_config(), tmp_path, seq_len)
    assert there <= 1e-4 and back <= 1e-4, (there, back)
    assert config["original_max_position_embeddings"] == 16
    assert config["rope_scaling"]["rope_type"] == "longrope"


def test_long_factors_change_the_logits_past_the_original_length():
    """The two regimes differ (so the parity above tests both), and a short sequence ignores long_factor."""
    cfg = ModelConfig(model_type="phi3", **SHAPE, max_position_embeddings=64,
                      rope_scaling={**LONGROPE, "original_max_position_embeddings": 16})
    same = ModelConfig(**{**cfg.to_dict(), "rope_scaling": {**cfg.rope_scaling, "long_factor": [1.0] * 8}})
    a, b = Transformer(cfg).eval(), Transformer(same).eval()
    b.load_state_dict(a.state_dict())
    ids = torch.randint(0, VOCAB, (1, 24))
    with torch.no_grad():
        assert torch.equal(a(ids[:, :16]).logits, b(ids[:, :16]).logits)
        assert (a(ids).logits - b(ids).logits).abs().max() > 1e-3


def test_packed_documents_take_their_own_factors():
    """A packed row gives each document the logits it gets alone, long and short documents side by side."""
    model = Transformer(ModelConfig.from_name("phi3-debug", max_position_embeddings=64, rope_scaling={
        **LONGROPE, "original_max_position_embeddings": 16})).eval()
    long_doc, short_doc = torch.randint(0, 320, (1, 24)), torch.randint(0, 320, (1, 10))
    positions = torch.cat([torch.arange(24), torch.arange(10)])[None]
    with torch.no_grad():
        packed = model(torch.cat([long_doc, short_doc], 1), position_ids=positions).logits
        torch.testing.assert_close(packed[:, :24], model(long_doc).logits, atol=1e-5, rtol=0)
        torch.testing.assert_close(packed[:, 24:], model(short_doc).logits, atol=1e-5, rtol=0)
    docs = torch.tensor([[5, 5, 5, 9, 9]])
    assert sequence_lengths(torch.tensor([[0, 1, 2, 0, 1]]), docs).tolist() == [[3, 3, 3, 2, 2]]


@pytest.mark.parametrize("scaling", [None, LONGROPE], ids=["plain", "longrope"])
def test_engine_greedy_equals_transformers_generate(tmp_path, scaling):
    """Prompts on both sides of the original length (16), decoding across it."""
    config = longrope_config() if scaling else phi3_config()
    prompts = [[int(t) for t in torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(n))]
               for n in (5, 14, 20)]
    expected, got = greedy_pair(transformers, config, tmp_path, prompts, max_tokens=6)
    assert got == expected


@pytest.mark.slow
def test_engine_prompt_chunks_take_the_whole_prompts_factors(tmp_path):
    """Prefill in chunks of 6 tokens: a 20-token prompt's first chunks lie within the original length (16) but
    take the long factors, as transformers' one forward over the prompt does."""
    prompts = [[int(t) for t in torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(n))]
               for n in (20, 13)]
    expected, got = greedy_pair(transformers, longrope_config(), tmp_path, prompts, max_tokens=6, max_step_tokens=6)
    assert got == expected
    alone = greedy_pair(transformers, longrope_config(), tmp_path / "alone", prompts[1:], max_tokens=6)
    assert alone[1] == alone[0]  # recomputed at the crossing with nothing else running


def test_session_turn_past_the_original_length_recomputes_its_history(tmp_path):
    """Turn one ends within 16 tokens; turn two passes it, so the history's keys are rotated again, and the reply
    equals transformers' generate over the whole conversation."""
    from astrai_pl.inference import Engine, SamplingParams

    hf = hf_random(transformers, longrope_config(), scale=0.5)
    hf.save_pretrained(tmp_path)
    engine = Engine(Transformer.from_pretrained(tmp_path).eval(), max_total_tokens=2048, page_size=4)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=True)
    chat = engine.session()
    first, second = [5, 9, 17, 33, 60, 71, 88, 90, 101, 7], [44, 12, 99, 3, 58]
    reply = chat.generate(first, params).token_ids
    got = chat.generate(second, params)
    history = first + reply + second  # 19 tokens: past the original 16
    with torch.no_grad():
        out = hf.generate(torch.tensor([history]), max_new_tokens=4, do_sample=False, pad_token_id=0,
                          eos_token_id=None, output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(history):].tolist()
    assert got.token_ids == tokens
    expected = [step.log_softmax(-1)[0, t].item() for step, t in zip(out.logits, tokens)]
    assert max(abs(a - b) for a, b in zip(got.logprobs, expected)) <= 1e-4  # the first token's too


def _saved(tmp_path, **fields):
    hf_random(transformers, longrope_config(**fields)).save_pretrained(tmp_path)
    return tmp_path


@pytest.mark.parametrize("key,value", [("resid_pdrop", 0.1), ("embd_pdrop", 0.1), ("attention_dropout", 0.1)])
def test_unsupported_fields_are_refused_by_name(tmp_path, key, value):
    folder = _saved(tmp_path)
    edit_json(folder / "config.json", lambda raw: raw.update({key: value}))
    with pytest.raises(UnsupportedCheckpointError, match=key):
        Transformer.from_pretrained(folder)


@pytest.mark.parametrize("scaling", [None, {**LONGROPE, "short_factor": LONGROPE["short_factor"][:4],
                                            "long_factor": LONGROPE["long_factor"][:4]}], ids=["plain", "longrope"])
def test_partial_rotary_parity_both_ways(tmp_path, scaling):
    """Phi-4-mini rotates 3/4 of each head; here half: the first 8 of 16 channels turn, 4 frequencies."""
    config = phi3_config(partial_rotary_factor=0.5, rope_scaling=scaling, original_max_position_embeddings=16)
    there, back, saved = round_trip_gaps(transformers, config, tmp_path, seq_len=24)
    assert there <= 1e-4 and back <= 1e-4, (there, back)
    assert saved["partial_rotary_factor"] == 0.5 and saved["rope_parameters"]["partial_rotary_factor"] == 0.5
    cfg = Transformer.from_pretrained(tmp_path / "ours").config
    assert cfg.rotary_dim == 8 and cfg.rope_type == ("longrope" if scaling else "default")


def test_partial_rotary_engine_greedy_and_bad_factors(tmp_path):
    prompts = [[int(t) for t in torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(n))]
               for n in (6, 15)]
    expected, got = greedy_pair(transformers, phi3_config(partial_rotary_factor=0.5), tmp_path, prompts, max_tokens=5)
    assert got == expected
    with pytest.raises(ConfigError, match="partial_rotary_factor"):  # 16 · 0.1 rotates 1 channel, no pair
        ModelConfig(model_type="phi3", **SHAPE, rope_scaling={"rope_type": "default", "partial_rotary_factor": 0.1})
    with pytest.raises(ExportError, match="partial_rotary_factor"):
        Transformer(ModelConfig(**SHAPE, rope_scaling={"rope_type": "default", "partial_rotary_factor": 0.5})
                    ).save_pretrained(tmp_path / "llama")


def test_old_su_name_reads_as_longrope_and_other_scalings_are_refused(tmp_path):
    folder = _saved(tmp_path)
    edit_json(folder / "config.json", lambda raw: raw.update(  # the older layout and name
        rope_scaling={**raw.pop("rope_parameters"), "rope_type": "su", "type": "su"}))
    assert Transformer.from_pretrained(folder).config.rope_type == "longrope"
    edit_json(folder / "config.json", lambda raw: raw.update(rope_scaling={"rope_type": "linear", "factor": 2.0},
                                                             rope_parameters=None))
    with pytest.raises(UnsupportedCheckpointError, match="rope_scaling.*longrope"):
        Transformer.from_pretrained(folder)
    with pytest.raises(ExportError, match="rope_type"):
        Transformer(ModelConfig(model_type="phi3", **SHAPE, rope_scaling={"rope_type": "linear", "factor": 2.0})
                    ).save_pretrained(tmp_path / "out")


def test_bad_longrope_factors_are_refused(tmp_path):
    folder = _saved(tmp_path)
    edit_json(folder / "config.json", lambda raw: raw["rope_parameters"].update(short_factor=[1.0, 2.0]))
    with pytest.raises(UnsupportedCheckpointError, match="short_factor"):
        Transformer.from_pretrained(folder)
    with pytest.raises(ConfigError, match="long_factor"):
        ModelConfig(model_type="phi3", **SHAPE, rope_scaling={**LONGROPE, "long_factor": None,
                                                              "original_max_position_embeddings": 16})


def test_fused_tensor_of_the_wrong_height_names_the_key(tmp_path):
    folder = _saved(tmp_path)
    edit_json(folder / "config.json", lambda raw: raw.update(num_key_value_heads=4))
    with pytest.raises(WeightShapeError, match="qkv_proj"):
        Transformer.from_pretrained(folder)


def test_preset_builds_and_round_trips(tmp_path):
    from astrai_pl.objectives.base import context_limit

    assert context_limit(ModelConfig.from_name("phi3-debug")) == 512  # longrope has no factor to multiply by
    model = Transformer(ModelConfig.from_name("phi3-debug")).eval()
    model.save_pretrained(tmp_path)
    again = Transformer.from_pretrained(tmp_path).eval()
    assert again.config.rope_scaling == model.config.rope_scaling
    ids = torch.randint(0, 320, (1, 260))  # past the preset's original 256: the long factors
    with torch.no_grad():
        assert torch.equal(model(ids).logits, again(ids).logits)


def test_adapters_on_fused_projections_are_refused_in_peft_files(tmp_path):
    """PEFT holds one A/B pair for qkv_proj or gate_up_proj, which no adapter here maps onto: merge instead."""
    from astrai_pl.model import LoraConfig, merge_lora
    from astrai_pl.model.hf import CheckpointError
    from astrai_pl.model.lora import apply_lora

    model = Transformer(ModelConfig.from_name("phi3-debug"))
    apply_lora(model, LoraConfig(r=2, target_modules=["qkv_proj", "o_proj"]))  # PEFT's names: q, k and v here
    with pytest.raises(ExportError, match="qkv_proj.*merge"):
        model.save_pretrained(tmp_path / "adapter")
    merge_lora(model).save_pretrained(tmp_path / "merged")  # the full model is written fused
    base = Transformer(ModelConfig.from_name("phi3-debug"))
    base.save_pretrained(tmp_path / "base")
    apply_lora(base, LoraConfig(r=2, target_modules=["o_proj", "down_proj"]))
    base.save_pretrained(tmp_path / "adapter")  # unfused projections: a PEFT adapter as usual
    edit_json(tmp_path / "adapter" / "adapter_config.json",
              lambda raw: raw.update(target_modules=["qkv_proj", "o_proj"]))
    with pytest.raises(CheckpointError, match="target_modules.*qkv_proj"):
        Transformer.from_pretrained(tmp_path / "base", adapter=tmp_path / "adapter")


def test_sliding_window_on_every_layer_as_transformers(tmp_path):
    """Phi-3-mini-4k's files set a window (2047): transformers slides every layer by it; tested past a window of 8."""
    there, back, config = round_trip_gaps(transformers, phi3_config(sliding_window=8, num_hidden_layers=6),
                                          tmp_path, seq_len=24)
    assert there <= 1e-4 and back <= 1e-4, (there, back)
    assert config["sliding_window"] == 8
    cfg = Transformer.from_pretrained(tmp_path / "hf").config
    assert all(cfg.layer_window(i) == 8 for i in range(cfg.num_hidden_layers))
