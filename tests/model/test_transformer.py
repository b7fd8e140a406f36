import pytest
import torch

from astrai_pl.model import ConfigError, ModelConfig, Transformer
from astrai_pl.model.layers import InputMajorWeights, Linear, RMSNorm, RotaryEmbedding, apply_rotary
from astrai_pl.ops import cpu


def test_rmsnorm_matches_torch_and_is_not_recentering():
    torch.manual_seed(0)
    x = torch.randn(3, 5)
    ours = RMSNorm(5, eps=1e-6)
    ours.weight.data = torch.randn(5)
    ref = torch.nn.RMSNorm(5, eps=1e-6)
    ref.weight.data.copy_(ours.weight.data)
    torch.testing.assert_close(ours(x), ref(x), rtol=1e-6, atol=1e-6)
    shifted = x + 10.0
    ln = torch.nn.LayerNorm(5, elementwise_affine=False)
    assert torch.allclose(ln(x), ln(shifted), atol=1e-5)
    assert not torch.allclose(ours(x), ours(shifted), atol=1e-3)


@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 2.0},
                                     {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}])
def test_rope_scores_depend_only_on_relative_position(scaling):
    cfg = ModelConfig.from_name("debug", rope_scaling=scaling)
    rope = RotaryEmbedding(cfg)
    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 1, cfg.head_size), torch.randn(1, 1, 1, cfg.head_size)

    def score(i: int, j: int) -> torch.Tensor:
        cq, sq = rope(torch.tensor([[i]]), torch.float32)
        ck, sk = rope(torch.tensor([[j]]), torch.float32)
        return (apply_rotary(q, cq, sq) * apply_rotary(k, ck, sk)).sum()

    for offset in (0, 5, 37, 200):
        torch.testing.assert_close(score(7 + offset, 3 + offset), score(7, 3), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(score(7, 3), score(9, 3))


@pytest.mark.parametrize("moe", [False, True])
def test_packed_row_gives_each_document_its_own_logits(moe):
    extra = dict(num_experts=4, num_experts_per_tok=2) if moe else {}
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_name("debug", **extra)).eval()
    docs = [torch.randint(3, 320, (n,)) for n in (5, 9, 3)]
    packed = torch.cat(docs)[None]
    positions = torch.cat([torch.arange(len(d)) for d in docs])[None]
    with torch.no_grad():
        logits = model(packed, position_ids=positions).logits[0]
        start = 0
        for d in docs:
            alone = model(d[None]).logits[0]
            torch.testing.assert_close(logits[start:start + len(d)], alone, rtol=1e-5, atol=1e-5)
            start += len(d)
        # explicit document ids give the same result as restarting positions
        doc_ids = torch.cat([torch.full((len(d),), i) for i, d in enumerate(docs)])[None]
        torch.testing.assert_close(model(packed, positions, document_ids=doc_ids).logits[0], logits)


def test_causal_prefix_is_unaffected_by_later_tokens():
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_name("debug")).eval()
    ids = torch.randint(0, 320, (2, 12))
    with torch.no_grad():
        full = model(ids).logits
        prefix = model(ids[:, :7]).logits
    torch.testing.assert_close(full[:, :7], prefix, rtol=1e-5, atol=1e-5)


def test_moe_aux_loss_is_returned_not_added():
    torch.manual_seed(0)
    cfg = ModelConfig.from_name("debug", num_experts=4, num_experts_per_tok=2, num_shared_experts=1,
                                shared_expert_gate=True, mlp_only_layers=[0])
    model = Transformer(cfg)
    assert not cfg.is_moe_layer(0) and cfg.is_moe_layer(1)
    out = model(torch.randint(0, 320, (2, 8)))
    assert out.aux_loss is not None and out.aux_loss.requires_grad
    # uniform routing gives aux = top_k exactly; anything else is larger on average
    assert out.aux_loss.item() >= 1.0
    dense = Transformer(ModelConfig.from_name("debug"))(torch.randint(0, 320, (1, 4)))
    assert dense.aux_loss is None


def test_init_scales_residual_projections():
    cfg = ModelConfig.from_name("small")
    model = Transformer(cfg)
    std_q = model.layers[0].self_attn.q_proj.weight.std().item()
    std_o = model.layers[0].self_attn.o_proj.weight.std().item()
    assert abs(std_q - 0.02) < 2e-3
    assert abs(std_o - 0.02 / (2 * cfg.num_hidden_layers) ** 0.5) < 1e-3
    assert cfg.num_parameters() == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("field,value,needle", [
    ("num_attention_heads", 5, "hidden_size"),
    ("num_key_value_heads", 3, "num_attention_heads"),
    ("model_type", "gpt2", "model_type"),
    ("rope_scaling", {"rope_type": "longrope2", "factor": 2.0}, "rope_type"),
])
def test_config_rejects_inconsistent_values(field, value, needle):
    with pytest.raises(ConfigError, match=needle):
        ModelConfig.from_name("debug", **{field: value})


def test_config_rejects_topk_above_experts():
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        ModelConfig.from_name("debug", num_experts=2, num_experts_per_tok=3)


def test_presets_build():
    for name in ("SmolLM2-135M", "Qwen2.5-0.5B", "Qwen3-0.6B", "Llama-3.2-1B"):
        cfg = ModelConfig.from_name(name)
        assert cfg.num_parameters() > 1e8
    assert abs(ModelConfig.from_name("SmolLM2-135M").num_parameters() / 134.5e6 - 1) < 0.01


@pytest.mark.parametrize("kernels", [False, None], ids=["in-out-copies", "panels-where-the-cpu-kernels-run"])
def test_input_major_copies_give_the_same_logits_and_follow_weight_updates(kernels):
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_name("debug", attention_bias=True)).eval()  # qkv biases too
    ids = torch.randint(0, 300, (2, 7))
    weights = InputMajorWeights()
    panels = kernels is None and cpu.available()
    with torch.no_grad(), cpu.override_available(kernels):
        plain = model(ids).logits
        with Linear.input_major(weights):
            joined = model(ids).logits
        layer = model.layers[0]
        # q/k/v and gate/up each go through one joined copy; o, down and the lm_head through their own
        qkv = weights.get(layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight, layer.self_attn.v_proj.weight)
        assert qkv.shape == (cpu.panels_shape(64 + 2 * 32, 64) if panels else (64, 64 + 2 * 32))
        assert len(weights._copies) == 4 * len(model.layers) + 1
        torch.testing.assert_close(joined, plain, rtol=1e-5, atol=1e-5)
        many = torch.randint(0, 300, (2, 40))  # 80 rows: a prefill, past what the panel kernel takes
        plain_many = model(many).logits
        with Linear.input_major(weights):
            torch.testing.assert_close(model(many).logits, plain_many, rtol=1e-5, atol=1e-5)
        for p in model.parameters():  # an optimizer step: in-place updates
            p.mul_(1.5)
        with Linear.input_major(weights):
            updated = model(ids).logits
        torch.testing.assert_close(updated, model(ids).logits, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(updated, plain)
        copies = {name: entry[2] for name, entry in weights._copies.items()}
        for p in model.parameters():  # unseen by the version counters (as a fused optimizer writes)
            p.data.mul_(2.0)
        weights.clear()
        with Linear.input_major(weights):
            cleared = model(ids).logits
        torch.testing.assert_close(cleared, model(ids).logits, rtol=1e-5, atol=1e-5)
        # recopied into the same memory, not into new tensors
        assert all(weights._copies[name][2] is copy for name, copy in copies.items())
    with Linear.input_major(weights):  # autograd on (training): plain nn.Linear, gradients reach the weights
        model(ids).logits.sum().backward()
    assert model.lm_head.weight.grad is not None


def test_input_major_leaves_inference_tensors_to_f_linear():
    weights = InputMajorWeights()
    with torch.inference_mode():
        linear = Linear(8, 4)  # parameters made in inference mode track no version
        x = torch.randn(3, 8)
        with Linear.input_major(weights):
            out = linear(x)
    assert weights.get(linear.weight) is None and not weights._copies
    torch.testing.assert_close(out, torch.nn.functional.linear(x, linear.weight, linear.bias))


def test_input_major_copies_of_replaced_weights_are_dropped():
    weights = InputMajorWeights()
    linear = Linear(8, 4)
    x = torch.randn(3, 8)
    with torch.no_grad(), Linear.input_major(weights):
        linear(x)
        linear.weight = torch.nn.Parameter(2 * linear.weight)  # a reload with new tensors
        out = linear(x)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, linear.weight, linear.bias))
    assert len(weights._copies) == 1  # the old weight is gone, and so is its copy


@pytest.mark.parametrize("amx", [False, True])
def test_cpu_autocast_attention_runs_in_float32_where_there_is_no_amx(monkeypatch, amx):
    """Without AMX, 16-bit flash attention is PyTorch's slow path on CPU: attention is upcast."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from astrai_pl.model import attention

    class SdpaDtypes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.dtypes = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "scaled_dot_product" in func.__name__:
                self.dtypes.add(args[0].dtype)
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(attention, "_cpu_has_amx", lambda: amx)
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_name("debug"))
    ids = torch.randint(0, 300, (2, 12))
    reference = model(ids).logits
    assert not attention.sdpa_in_float32(reference)  # no autocast: nothing to decide
    with torch.autocast("cpu", dtype=torch.bfloat16), SdpaDtypes() as seen:
        mixed = model(ids).logits
        mixed.float().sum().backward()
    assert seen.dtypes == ({torch.bfloat16} if amx else {torch.float32})
    assert all(p.grad is not None and p.grad.isfinite().all() for p in model.parameters())
    torch.testing.assert_close(mixed.float(), reference, rtol=0.05, atol=0.05)  # bf16 matmuls either way
