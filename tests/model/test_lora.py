"""LoRA on the shared Transformer: what it computes, and PEFT's adapter format in both directions."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_hf import our_model

from astrai_pl.model import ConfigError, LoraConfig, Transformer, adapters_disabled, merge_lora
from astrai_pl.model.adapter_files import ADAPTER_CONFIG, ADAPTER_WEIGHTS, load_adapter
from astrai_pl.model.hf import CheckpointError
from astrai_pl.model.hf_keys import export_tensors
from astrai_pl.model.lora import LoraLinear, apply_lora, lora_modules, trainable_summary
from astrai_pl.tokenizer import Tokenizer

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

ROUND_TRIP = ["llama", "qwen2", "qwen3", "qwen3_moe", "mixtral"]


def adapted(model_type: str, seed: int = 0, base_dir=None, **lora) -> Transformer:
    """A model of `model_type` with an adapter whose B is noise (a fresh B is zero and would prove nothing);
    its base is first saved to `base_dir` when given."""
    model = our_model(model_type)
    if base_dir is not None:
        model.save_pretrained(base_dir)
    apply_lora(model, LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": "all-linear", **lora}))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model.eval()


def ids(model: Transformer) -> torch.Tensor:
    return torch.randint(0, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(1))


def peft_model(base_dir, adapter_dir):
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, attn_implementation="eager")
    return peft.PeftModel.from_pretrained(base, adapter_dir).eval()


# -- what an adapter computes ------------------------------------------------------------------------------
def test_fresh_adapter_computes_the_base_and_only_it_trains():
    model = our_model("llama")
    x = ids(model)
    before = model(x).logits
    apply_lora(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    assert torch.equal(model(x).logits, before)  # B starts at zero, as PEFT's
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert {n.rsplit(".", 3)[-3] for n in trainable} == {"q_proj", "v_proj"}
    assert trainable_summary(model).startswith(f"trainable {sum(p.numel() for n, p in model.named_parameters() if n in trainable):,} of ")


def test_initialisation_is_peft_s_and_reset_parameters_leaves_b_at_zero():
    model = our_model("llama")
    apply_lora(model, LoraConfig(r=8))
    model.reset_parameters()  # the base's initialisation must not touch the adapters
    for _, module in lora_modules(model):
        assert torch.count_nonzero(module.lora_B.weight) == 0
        bound = 1 / module.in_features ** 0.5  # kaiming_uniform(a=√5) on (r, in): U(-1/√in, 1/√in)
        a = module.lora_A.weight
        assert a.abs().max() <= bound and a.std() > bound / 3


@pytest.mark.parametrize("rslora", [False, True])
def test_the_update_is_scaled_by_alpha_over_r_or_root_r(rslora):
    model = adapted("llama", r=4, lora_alpha=12, use_rslora=rslora, target_modules=["o_proj"])
    name, module = lora_modules(model)[0]
    x = torch.randn(3, module.in_features)
    base = torch.nn.functional.linear(x, module.weight)
    s = 12 / (2 if rslora else 4)
    expected = base + s * x @ module.lora_A.weight.T @ module.lora_B.weight.T
    torch.testing.assert_close(module(x), expected)
    torch.testing.assert_close(module.merged_weight(), module.weight + s * module.lora_B.weight @ module.lora_A.weight)


def test_adapters_disabled_gives_the_base_and_keeps_a_recorded_graph_valid(tmp_path):
    model = adapted("llama", modules_to_save=["lm_head"], base_dir=tmp_path / "base")
    base = Transformer.from_pretrained(tmp_path / "base").eval()
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)  # a trained module_to_save
    x = ids(model)
    policy = model(x).logits
    with adapters_disabled(model), torch.no_grad():
        reference = model(x).logits
    torch.testing.assert_close(reference, base(x).logits)
    assert not torch.allclose(policy, reference)
    policy.sum().backward()  # the swap left autograd's saved tensors alone
    assert model.lm_head.weight.grad is not None


def test_merge_gives_a_plain_model_with_the_adapted_weights():
    model = adapted("qwen3")
    x = ids(model)
    expected = model(x).logits
    merge_lora(model)
    assert model.lora_config is None and not lora_modules(model)
    torch.testing.assert_close(model(x).logits, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("lora, fix", [
    (dict(r=0), "rank"),
    (dict(lora_alpha=-1), "positive"),
    (dict(lora_dropout=1.0), "[0, 1)"),
    (dict(bias="all"), "bias: none"),
    (dict(target_modules=["nope"]), "matches no linear layer"),
    (dict(target_modules="(unclosed"), "not a regular expression"),
    (dict(target_modules="(.*.*)*x"), "matches no linear layer"),  # RE2: linear time (Python re: hours)
    (dict(modules_to_save=["nope"]), "names no module"),
])
def test_bad_lora_settings_are_refused_naming_the_field(lora, fix):
    with pytest.raises(ConfigError, match="model.init_args.lora") as err:
        apply_lora(our_model("llama"), LoraConfig(**lora))
    assert fix in str(err.value)


def test_moe_experts_and_routers_are_refused_and_all_linear_leaves_them_out():
    model = our_model("qwen3_moe")
    with pytest.raises(ConfigError, match="MoE experts or routers"):
        apply_lora(model, LoraConfig(target_modules=["gate_proj"]))
    apply_lora(model, LoraConfig(target_modules="all-linear"))
    adapted_names = {n for n, _ in lora_modules(model)}
    assert adapted_names and all(".self_attn." in n for n in adapted_names)


# -- PEFT's format, both ways -------------------------------------------------------------------------------
@pytest.mark.parametrize("model_type", ROUND_TRIP)
def test_our_adapter_loads_in_peft_with_our_logits(tmp_path, model_type):
    model = adapted(model_type, base_dir=tmp_path / "base")
    model.save_pretrained(tmp_path / "adapter")
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == [".astrai-pl-export.json", ADAPTER_CONFIG,
                                                                        ADAPTER_WEIGHTS]
    keys = load_file(tmp_path / "adapter" / ADAPTER_WEIGHTS)
    assert all(k.startswith("base_model.model.model.layers.") and k.endswith((".lora_A.weight", ".lora_B.weight"))
               for k in keys)
    theirs = peft_model(tmp_path / "base", tmp_path / "adapter")
    x = ids(model)
    torch.testing.assert_close(model(x).logits, theirs(x).logits, atol=1e-4, rtol=0)


def test_an_adapter_s_tokenizer_templates_the_ids_its_model_was_trained_on(tmp_path):
    """The adapter folder's chat template leads with the BOS, as a full export's does: transformers (and a
    server) applying it give the ids our engine gives the model, every training row starting with BOS."""
    tokenizer = Tokenizer.byte_level()
    adapted("llama").save_pretrained(tmp_path / "adapter", tokenizer=tokenizer)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "adapter")
    chat = [{"role": "user", "content": "What is 2 + 3?"}]
    text = theirs.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    ours = tokenizer.apply_chat_template(chat, add_generation_prompt=True)
    assert theirs(text, add_special_tokens=False).input_ids == [tokenizer.bos_token_id, *ours]


@pytest.mark.parametrize("model_type", ROUND_TRIP)
def test_a_peft_written_adapter_loads_here_with_peft_s_logits_and_merges_as_peft_does(tmp_path, model_type):
    our_model(model_type).save_pretrained(tmp_path / "base")
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", attn_implementation="eager")
    # PEFT's all-linear on a MoE model also adapts the fused experts (target_parameters): refused below
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"] if "moe" in model_type or model_type == "mixtral" else "all-linear"
    theirs = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=16, target_modules=targets,
                                                       lora_dropout=0.1, init_lora_weights=False))
    theirs.save_pretrained(tmp_path / "adapter")
    theirs.eval()
    ours = Transformer.from_pretrained(tmp_path / "base", adapter=tmp_path / "adapter").eval()
    x = ids(ours)
    torch.testing.assert_close(ours(x).logits, theirs(x).logits, atol=1e-4, rtol=0)
    merged = dict(theirs.merge_and_unload().state_dict())
    mine = dict(export_tensors(merge_lora(ours), ours.config))
    attention = {k for k in merged if ".self_attn." in k and k.endswith("proj.weight")}
    assert attention and attention <= mine.keys()  # MoE experts are fused in transformers' state dict
    for key, tensor in merged.items():
        if key in mine:
            torch.testing.assert_close(mine[key], tensor, atol=1e-5, rtol=0)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_a_peft_adapter_on_fused_moe_experts_is_refused_naming_target_parameters(tmp_path, model_type):
    our_model(model_type).save_pretrained(tmp_path / "base")
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules="all-linear")).save_pretrained(tmp_path / "adapter")
    with pytest.raises(CheckpointError, match="target_parameters"):
        Transformer.from_pretrained(tmp_path / "base", adapter=tmp_path / "adapter")


def test_modules_to_save_travel_in_peft_s_names(tmp_path):
    model = adapted("llama", modules_to_save=["lm_head"], base_dir=tmp_path / "base")
    with torch.no_grad():
        model.lm_head.weight.mul_(1.5)
    model.save_pretrained(tmp_path / "adapter")
    assert "base_model.model.lm_head.weight" in load_file(tmp_path / "adapter" / ADAPTER_WEIGHTS)
    theirs = peft_model(tmp_path / "base", tmp_path / "adapter")
    x = ids(model)
    torch.testing.assert_close(model(x).logits, theirs(x).logits, atol=1e-4, rtol=0)
    back = Transformer.from_pretrained(tmp_path / "base", adapter=tmp_path / "adapter").eval()
    torch.testing.assert_close(back(x).logits, model(x).logits, atol=1e-5, rtol=0)


# -- bad adapter directories ---------------------------------------------------------------------------------
def saved_adapter(tmp_path):
    model = adapted("llama")
    model.save_pretrained(tmp_path / "adapter")
    return tmp_path / "adapter"


@pytest.mark.parametrize("field, value", [("use_dora", True), ("fan_in_fan_out", True), ("peft_type", "IA3"),
                                          ("rank_pattern", {"q_proj": 2}), ("r", 0)])
def test_an_adapter_this_model_cannot_compute_exactly_is_refused_naming_file_and_field(tmp_path, field, value):
    folder = saved_adapter(tmp_path)
    config = json.loads((folder / ADAPTER_CONFIG).read_text())
    config[field] = value
    (folder / ADAPTER_CONFIG).write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=ADAPTER_CONFIG) as err:
        load_adapter(our_model("llama"), folder)
    assert field in str(err.value) or "peft_type" in str(err.value)


@pytest.mark.parametrize("damage", ["extra", "shape", "nan", "missing"])
def test_adapter_weights_that_do_not_fit_are_refused_naming_the_tensor(tmp_path, damage):
    folder = saved_adapter(tmp_path)
    tensors = load_file(folder / ADAPTER_WEIGHTS)
    key = sorted(tensors)[0]
    if damage == "extra":
        tensors["base_model.model.model.layers.9.mlp.up_proj.lora_A.weight"] = torch.zeros(4, 64)
    elif damage == "shape":
        tensors[key] = torch.zeros(3, 3)
    elif damage == "nan":
        tensors[key] = torch.full_like(tensors[key], float("nan"))
    else:
        del tensors[key]
    save_file(tensors, folder / ADAPTER_WEIGHTS)
    with pytest.raises(CheckpointError, match=ADAPTER_WEIGHTS):
        load_adapter(our_model("llama"), folder)


def test_a_second_adapter_on_an_adapted_model_is_refused(tmp_path):
    model = adapted("llama")
    with pytest.raises(ConfigError, match="already has an adapter"):
        apply_lora(model, LoraConfig())
    assert isinstance(model.get_submodule("layers.0.self_attn.q_proj"), LoraLinear)
