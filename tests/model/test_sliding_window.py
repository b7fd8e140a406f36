"""Sliding-window attention: applied in training (causal and packed) and in the engine, equal to transformers
for Mistral (every layer) and Qwen2 (layers from max_window_layers on) beyond the window."""

import pytest
import torch
from family_parity import greedy_pair, round_trip_gaps

from astrai_pl.inference import Engine, SamplingParams
from astrai_pl.inference.attention.backends import (
    BackendUnavailable,
    attn_backend,
    model_features,
    select_backend,
)
from astrai_pl.model import ModelConfig, Transformer
from astrai_pl.model.hf import ExportError
from astrai_pl.ops import cpu as cpu_ops

transformers = pytest.importorskip("transformers")

SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, sliding_window=4)
HF = {
    "mistral": lambda: transformers.MistralConfig(**SHAPE),
    "qwen2": lambda: transformers.Qwen2Config(**SHAPE, use_sliding_window=True, max_window_layers=1),
}

MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
OTHER_HF = {  # each family's own rule for which layers slide (hf_attention.py)
    "qwen3": lambda: transformers.Qwen3Config(**SHAPE, head_dim=16, use_sliding_window=True, max_window_layers=2),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(**SHAPE, **MOE, shared_expert_intermediate_size=48,
                                                     use_sliding_window=True, max_window_layers=3),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**SHAPE, **MOE, head_dim=16, use_sliding_window=True),
    "mixtral": lambda: transformers.MixtralConfig(**SHAPE, num_local_experts=4),
}


@pytest.mark.parametrize("family", sorted(HF) + [pytest.param(f, marks=pytest.mark.slow) for f in sorted(OTHER_HF)])
def test_logits_equal_transformers_beyond_the_window(family, tmp_path):
    make = {**HF, **OTHER_HF}[family]
    there, back, written = round_trip_gaps(transformers, make(), tmp_path, seq_len=20)  # 5x the window
    assert there <= 1e-4 and back <= 1e-4
    assert written["sliding_window"] == 4


def test_qwen2_layer_types_follow_max_window_layers(tmp_path):
    round_trip_gaps(transformers, HF["qwen2"](), tmp_path)
    model = Transformer.from_pretrained(tmp_path / "ours")
    assert [model.config.layer_window(i) for i in range(3)] == [None, 4, 4]


def test_the_window_changes_the_logits():
    """Old code recorded the window and ignored it: a window of 4 gave the logits of none."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_name("debug", model_type="mistral", sliding_window=4)).eval()
    full = Transformer(ModelConfig.from_name("debug", model_type="mistral")).eval()
    full.load_state_dict(model.state_dict())
    ids = torch.randint(0, 320, (1, 12))
    with torch.no_grad():
        windowed, plain = model(ids).logits, full(ids).logits
    assert torch.equal(windowed[:, :4], plain[:, :4])  # within the window: the same
    assert (windowed[:, 4:] - plain[:, 4:]).abs().max() > 1e-3


@pytest.mark.parametrize("packing", ["position_ids", "document_ids"])
def test_packed_documents_keep_their_own_window(packing):
    torch.manual_seed(0)
    cfg = ModelConfig.from_name("debug", model_type="qwen2", sliding_window=3, attention_bias=True,
                                layer_types=["sliding_attention", "full_attention"])
    model = Transformer(cfg).eval()
    docs = [torch.randint(0, 320, (n,)) for n in (7, 9)]
    row = torch.cat(docs)[None]
    kwargs = {"position_ids": torch.cat([torch.arange(len(d)) for d in docs])[None]} if packing == "position_ids" \
        else {"document_ids": torch.cat([torch.full((len(d),), i) for i, d in enumerate(docs)])[None]}
    with torch.no_grad():
        packed = model(row, **kwargs).logits[0]
        alone = torch.cat([model(d[None]).logits[0] for d in docs])
    assert (packed - alone).abs().max() <= 1e-5


@pytest.mark.parametrize("family", sorted(HF))
def test_engine_greedy_equals_transformers_generate(family, tmp_path):
    prompts = [[5, 9, 30], list(range(20, 33)), [11] * 7]  # shorter and longer than the window
    expected, got = greedy_pair(transformers, HF[family](), tmp_path, prompts, max_tokens=10)
    assert got == expected
    model = Transformer.from_pretrained(tmp_path / "hf").eval()
    for kernels in (False, True):  # the decode group through SDPA with a windowed mask, and the CPU kernel
        for page_size in (1, 16):
            with cpu_ops.override_available(kernels):
                engine = Engine(model, max_total_tokens=512, page_size=page_size)
                out = engine.generate(prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
            assert [c.token_ids for c in out] == expected, (kernels, page_size)


def test_the_fused_cuda_kernels_take_a_window():
    cfg = ModelConfig.from_name("debug", model_type="mistral", sliding_window=4)
    needs = model_features(cfg)
    assert needs == ("sliding_window",)
    assert select_backend(torch.device("cpu"), torch.float32, needs).name == "torch"
    with attn_backend("cuda"), pytest.raises(BackendUnavailable, match="CUDA only") as refused:
        select_backend(torch.device("cpu"), torch.float32, needs)
    assert "sliding_window" not in str(refused.value)  # only the device stands in the way


def test_a_window_transformers_would_not_apply_is_not_exported(tmp_path):
    llama = Transformer(ModelConfig.from_name("debug", sliding_window=4))
    with pytest.raises(ExportError, match="sliding_window"):
        llama.save_pretrained(tmp_path / "llama")
    mixed = Transformer(ModelConfig.from_name("debug", model_type="mistral", sliding_window=4,
                                              layer_types=["sliding_attention", "full_attention"]))
    with pytest.raises(ExportError, match="layer_types"):
        mixed.save_pretrained(tmp_path / "mistral")


def test_bad_window_fields_are_refused_by_name():
    from astrai_pl.model.config import ConfigError

    with pytest.raises(ConfigError, match="sliding_window"):
        ModelConfig.from_name("debug", sliding_window=0)
    with pytest.raises(ConfigError, match="layer_types"):
        ModelConfig.from_name("debug", sliding_window=4, layer_types=["sliding_attention"])
    with pytest.raises(ConfigError, match="layer_types"):
        ModelConfig.from_name("debug", sliding_window=4, layer_types=["local", "global"])


def test_the_cpu_decode_kernel_is_given_each_layers_window(monkeypatch):
    if not cpu_ops.available():
        pytest.skip(f"the fused CPU kernels do not build here: {cpu_ops.unavailable_reason()}")
    seen = []
    kernel = cpu_ops.paged_decode_attention

    def recording(*args, **kwargs):
        seen.append(kwargs.get("window"))
        return kernel(*args, **kwargs)

    monkeypatch.setattr(cpu_ops, "paged_decode_attention", recording)
    cfg = ModelConfig.from_name("debug", model_type="qwen2", sliding_window=3, attention_bias=True,
                                layer_types=["full_attention", "sliding_attention"])
    engine = Engine(Transformer(cfg).eval(), max_total_tokens=256, page_size=1)
    engine.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert seen and set(seen) == {None, 3}
