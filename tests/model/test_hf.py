"""Hugging Face round-trip: transformers' checkpoints load here with its logits, and ours load in transformers."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from astrai_pl.model import ModelConfig, Transformer
from astrai_pl.model.hf import (
    CheckpointError,
    CheckpointNotFoundError,
    ExportError,
    MissingWeightError,
    UnexpectedWeightError,
    UnsupportedCheckpointError,
    WeightShapeError,
)

transformers = pytest.importorskip("transformers")

SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=32)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
HF = {  # model_type: (transformers config class name, fields beyond SHAPE)
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 32}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2_moe": ("Qwen2MoeConfig", {**MOE, "shared_expert_intermediate_size": 48, "mlp_only_layers": [1]}),
    "qwen3_moe": ("Qwen3MoeConfig", {**MOE, "head_dim": 32, "norm_topk_prob": True}),
}
OURS = {  # model_type: ModelConfig fields beyond SHAPE
    "llama": {},
    "mistral": {},
    "qwen2": {"attention_bias": True},
    "qwen3": {"qk_norm": True, "head_dim": 32},
    "mixtral": {"num_experts": 4},
    "qwen2_moe": {**MOE, "num_shared_experts": 1, "shared_expert_intermediate_size": 48,
                  "shared_expert_gate": True, "norm_topk_prob": False, "mlp_only_layers": [0]},
    "qwen3_moe": {**MOE, "qk_norm": True},
}
ROPE = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "beta_fast": 8.0},
}


def perturbed(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Noise on every tensor, so norms are not all-ones, biases not zero and routers far from ties."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    return model.eval()


def hf_model(model_type: str, **fields):
    cls_name, extra = HF[model_type]
    config = getattr(transformers, cls_name)(**{**SHAPE, **extra, **fields})
    return perturbed(transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager"))


def our_model(model_type: str, **fields) -> Transformer:
    return perturbed(Transformer(ModelConfig(model_type=model_type, **{**SHAPE, **OURS[model_type], **fields})))


def hf_load(path):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model.eval()


def assert_same_logits(hf, ours, seq_len: int = 16) -> None:
    ids = torch.randint(0, SHAPE["vocab_size"], (2, seq_len), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (hf(ids).logits - ours(ids).logits).abs().max().item()
    assert diff <= 1e-4, diff


def edit_json(path, edit) -> None:
    raw = json.loads(path.read_text())
    edit(raw)
    path.write_text(json.dumps(raw))


# -- parity, both directions -------------------------------------------------------------------------------
@pytest.mark.parametrize("model_type", list(HF))
def test_transformers_checkpoint_loads_with_same_logits(tmp_path, model_type):
    hf = hf_model(model_type)
    hf.save_pretrained(tmp_path)
    assert_same_logits(hf, Transformer.from_pretrained(tmp_path).eval())


@pytest.mark.parametrize("model_type", list(OURS))
def test_our_checkpoint_loads_in_transformers_with_same_logits(tmp_path, model_type):
    ours = our_model(model_type)
    ours.save_pretrained(tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == [HF[model_type][0].replace("Config", "ForCausalLM")]
    assert_same_logits(hf_load(tmp_path / "out"), ours)
    assert_same_logits(Transformer.from_pretrained(tmp_path / "out").eval(), ours)


def test_fused_expert_tensors_load(tmp_path):
    """transformers 5 keeps experts fused in memory (experts.gate_up_proj, experts.down_proj); read that too."""
    hf = hf_model("qwen3_moe")
    hf.save_pretrained(tmp_path)
    fused = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in fused
    save_file(fused, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    assert_same_logits(hf, Transformer.from_pretrained(tmp_path).eval())


# -- RoPE scalings and both config.json layouts ------------------------------------------------------------
def _old_layout(raw: dict) -> None:
    """Rewrite transformers 5's rope_parameters as the 4.x layout: top-level rope_theta + rope_scaling{type}."""
    params = raw.pop("rope_parameters")
    raw["rope_theta"] = params.pop("rope_theta")
    kind = params.pop("rope_type")
    raw["rope_scaling"] = None if kind == "default" else {"type": kind, **params}


@pytest.mark.parametrize("layout", ["rope_parameters", "rope_scaling"])
@pytest.mark.parametrize("scaling", ["default", *ROPE])
def test_rope_scaling_parity_from_transformers(tmp_path, scaling, layout):
    params = {"rope_type": "default", **ROPE.get(scaling, {}), "rope_theta": 500.0}
    hf = hf_model("llama", rope_parameters=params)
    hf.save_pretrained(tmp_path)
    if layout == "rope_scaling":
        edit_json(tmp_path / "config.json", _old_layout)
        assert_same_logits(hf, hf_load(tmp_path), seq_len=48)  # transformers reads the edit as we do
    ours = Transformer.from_pretrained(tmp_path).eval()
    assert ours.config.rope_type == scaling and ours.config.rope_theta == 500.0
    assert_same_logits(hf, ours, seq_len=48)  # 48 > max_position_embeddings=32: dynamic scaling is active


@pytest.mark.parametrize("scaling", list(ROPE))
def test_rope_scaling_parity_into_transformers(tmp_path, scaling):
    ours = our_model("llama", rope_theta=500.0, rope_scaling=dict(ROPE[scaling]))
    ours.save_pretrained(tmp_path / "out")
    assert_same_logits(hf_load(tmp_path / "out"), ours, seq_len=48)


# -- sharding, tying, dtype --------------------------------------------------------------------------------
def test_sharded_round_trip(tmp_path):
    ours = our_model("qwen2_moe")
    ours.save_pretrained(tmp_path / "out", max_shard_size=40_000)
    shards = sorted(p.name for p in (tmp_path / "out").glob("*.safetensors"))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    assert_same_logits(Transformer.from_pretrained(tmp_path / "out").eval(), ours)
    assert_same_logits(hf_load(tmp_path / "out"), ours)


def test_sharded_transformers_checkpoint_loads(tmp_path):
    hf = hf_model("mixtral")
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert_same_logits(hf, Transformer.from_pretrained(tmp_path).eval())


@pytest.mark.parametrize("tied", [True, False])
def test_tied_and_untied_embeddings(tmp_path, tied):
    hf = hf_model("qwen3", tie_word_embeddings=tied)
    hf.save_pretrained(tmp_path / "hf")
    ours = Transformer.from_pretrained(tmp_path / "hf").eval()
    assert (ours.lm_head.weight is ours.embed_tokens.weight) == tied
    assert_same_logits(hf, ours)
    ours.save_pretrained(tmp_path / "ours")
    assert ("lm_head.weight" in load_file(tmp_path / "ours" / "model.safetensors")) != tied
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["tie_word_embeddings"] == tied
    assert_same_logits(hf_load(tmp_path / "ours"), ours)


def test_dtype_casts_and_is_recorded(tmp_path):
    our_model("llama").save_pretrained(tmp_path / "out")
    model = Transformer.from_pretrained(tmp_path / "out", dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    model.save_pretrained(tmp_path / "bf16")
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    generation = json.loads((tmp_path / "bf16" / "generation_config.json").read_text())
    assert generation["bos_token_id"] == 1 and generation["eos_token_id"] == 2


# -- saving is atomic --------------------------------------------------------------------------------------
class FakeTokenizer:
    def __init__(self, fail: bool = False):
        self.fail = fail

    def save_pretrained(self, path) -> None:
        if self.fail:
            raise RuntimeError("disk full")
        (Path(path) / "tokenizer.json").write_text("{}")


def test_failed_save_leaves_no_directory(tmp_path):
    with pytest.raises(RuntimeError, match="disk full"):
        our_model("llama").save_pretrained(tmp_path / "out", tokenizer=FakeTokenizer(fail=True))
    assert list(tmp_path.iterdir()) == []


def test_save_over_existing_directory_replaces_weights_and_keeps_other_files(tmp_path):
    out = tmp_path / "out"
    our_model("llama").save_pretrained(out, max_shard_size=20_000, tokenizer=FakeTokenizer())
    (out / "README.md").write_text("notes")
    ours = our_model("llama")
    perturbed(ours, seed=3).save_pretrained(out)
    assert sorted(p.name for p in out.iterdir()) == [".astrai-pl-export.json", "README.md", "config.json",
                                                     "generation_config.json", "model.safetensors", "tokenizer.json"]
    assert_same_logits(Transformer.from_pretrained(out).eval(), ours)
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


# -- bad input: one typed error naming the file, the key and the fix ---------------------------------------
@pytest.fixture
def saved(tmp_path):
    our_model("llama").save_pretrained(tmp_path / "ckpt")
    return tmp_path / "ckpt"


def _edit_weights(folder, edit) -> None:
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def test_unknown_model_type(saved):
    edit_json(saved / "config.json", lambda raw: raw.update(model_type="gpt2"))
    with pytest.raises(UnsupportedCheckpointError, match=r"config\.json: key 'model_type' is 'gpt2'.*Fix"):
        Transformer.from_pretrained(saved)


def test_missing_directory_and_config(tmp_path, saved):
    with pytest.raises(CheckpointNotFoundError, match="nowhere.*not a directory.*Fix") as err:
        Transformer.from_pretrained(tmp_path / "nowhere")
    assert isinstance(err.value, FileNotFoundError)
    (saved / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"config\.json does not exist.*Fix"):
        Transformer.from_pretrained(saved)


def test_missing_weight(saved):
    _edit_weights(saved, lambda t: t.pop("model.layers.1.mlp.down_proj.weight"))
    with pytest.raises(MissingWeightError, match=r"model\.safetensors.*'model\.layers\.1\.mlp\.down_proj\.weight'.*Fix"):
        Transformer.from_pretrained(saved)


def test_unexpected_weight(saved):
    _edit_weights(saved, lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}))
    with pytest.raises(UnexpectedWeightError, match=r"model\.safetensors: 'model\.layers\.0\.self_attn\.q_proj\.bias'.*Fix"):
        Transformer.from_pretrained(saved)


def test_wrong_shape(saved):
    _edit_weights(saved, lambda t: t.update({"model.norm.weight": torch.ones(65)}))
    with pytest.raises(WeightShapeError, match=r"model\.safetensors: 'model\.norm\.weight' gives \(65,\), expected \(64,\).*Fix"):
        Transformer.from_pretrained(saved)


def test_corrupt_weight_file(saved):
    (saved / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match=r"model\.safetensors is not a readable safetensors file.*Fix"):
        Transformer.from_pretrained(saved)


def test_unsupported_options_are_refused(saved):
    edit_json(saved / "config.json", lambda raw: raw.update(mlp_bias=True))
    with pytest.raises(UnsupportedCheckpointError, match="'mlp_bias'.*Fix"):
        Transformer.from_pretrained(saved)
    with pytest.raises(ExportError, match="attention_bias=True.*Fix"):
        our_model("mistral", attention_bias=True).save_pretrained(saved.parent / "x")
