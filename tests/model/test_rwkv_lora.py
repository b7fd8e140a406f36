"""LoRA on RWKV models: target names are PEFT's (transformers' RwkvForCausalLM module names), adapters
travel to and from PEFT with the same logits, and a LoRA SFT run on rwkv-debug trains only the adapter and
exports it."""

import pytest
import torch
from fit_runs import quiet_trainer
from test_rwkv import rwkv_model

from astrai_pl.callbacks.export import export_pretrained
from astrai_pl.data import Arithmetic, SFTData
from astrai_pl.model import ConfigError, LoraConfig, Transformer
from astrai_pl.model.lora import adapter_state, apply_lora, hf_module_name, lora_modules
from astrai_pl.objectives import SFT

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

TIME_MIX = {"attention.key", "attention.value", "attention.receptance", "attention.output"}
CHANNEL_MIX = {"feed_forward.key", "feed_forward.value", "feed_forward.receptance"}


def adapted_names(model) -> set[str]:
    """The block-relative names of the adapted projections, e.g. attention.key."""
    return {name.split(".", 2)[2] for name, _ in lora_modules(model)}


def noisy_adapter(model) -> Transformer:
    """Give every lora_B noise: a fresh B is zero and would prove nothing."""
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model.eval()


def ids(seed=1):
    return torch.randint(0, 320, (2, 13), generator=torch.Generator().manual_seed(seed))


def test_default_targets_are_what_peft_adapts_on_transformers_rwkv(tmp_path):
    model = rwkv_model()
    model.save_pretrained(tmp_path / "base")
    apply_lora(model, LoraConfig(r=4))
    assert adapted_names(model) == TIME_MIX | CHANNEL_MIX  # key, value, receptance match both mixes
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    theirs = peft.get_peft_model(base, peft.LoraConfig(r=4))
    peft_names = {n.removeprefix("base_model.model.") for n, m in theirs.named_modules()
                  if isinstance(m, peft.tuners.lora.LoraLayer)}
    assert {hf_module_name(n, "rwkv") for n, _ in lora_modules(model)} == peft_names


@pytest.mark.parametrize("targets, expected", [
    (["attention.key", "attention.value", "attention.receptance", "attention.output"], TIME_MIX),
    (["feed_forward.key", "feed_forward.value", "feed_forward.receptance"], CHANNEL_MIX),
    ("all-linear", TIME_MIX | CHANNEL_MIX),
    (r"rwkv\.blocks\.\d+\.attention\.(key|value)", {"attention.key", "attention.value"}),
])
def test_peft_names_select_the_rwkv_projections(targets, expected):
    model = rwkv_model()
    apply_lora(model, LoraConfig(r=4, target_modules=targets))
    assert adapted_names(model) == expected
    assert "lm_head" not in {n for n, _ in lora_modules(model)}


def test_attention_names_on_rwkv_are_refused_naming_the_rwkv_projections():
    with pytest.raises(ConfigError, match=r"target_modules=\['q_proj'\] matches no linear layer of this rwkv "
                                          r"model; name some of attention\.key"):
        apply_lora(rwkv_model(), LoraConfig(target_modules=["q_proj"]))


def test_our_rwkv_adapter_loads_in_peft_with_our_logits(tmp_path):
    model = rwkv_model()
    model.save_pretrained(tmp_path / "base")
    apply_lora(model, LoraConfig(r=4, lora_alpha=8))
    noisy_adapter(model).save_pretrained(tmp_path / "adapter")
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    theirs = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(model(ids()).logits, theirs(ids()).logits, atol=1e-4, rtol=0)


def test_a_peft_written_rwkv_adapter_loads_here_with_peft_s_logits(tmp_path):
    rwkv_model().save_pretrained(tmp_path / "base")
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    theirs = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=16, target_modules="all-linear",
                                                       init_lora_weights=False))
    theirs.save_pretrained(tmp_path / "adapter")
    ours = Transformer.from_pretrained(tmp_path / "base", adapter=tmp_path / "adapter").eval()
    assert adapted_names(ours) == TIME_MIX | CHANNEL_MIX
    with torch.no_grad():
        torch.testing.assert_close(ours(ids()).logits, theirs.eval()(ids()).logits, atol=1e-4, rtol=0)


def test_lora_sft_on_rwkv_debug_trains_only_the_adapter_and_exports_it(tmp_path):
    rwkv_model().save_pretrained(tmp_path / "base")
    torch.manual_seed(0)
    data = SFTData(synthetic=Arithmetic(train_rows=48, test_rows=8), max_seq_len=64, batch_size=4,
                   cache_dir=str(tmp_path / "cache"))
    sft = SFT(init_from=str(tmp_path / "base"), lora=LoraConfig(r=4, lora_alpha=8), tokenizer=data.tokenizer,
              optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2))
    trainable = {n for n, p in sft.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    start = {k: v.clone() for k, v in adapter_state(sft.model).items()}
    quiet_trainer(max_steps=3, limit_val_batches=0).fit(sft, datamodule=data)

    base = Transformer.from_pretrained(tmp_path / "base").state_dict()
    state = sft.model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in base.items())  # the frozen base, bit for bit
    adapter = adapter_state(sft.model)
    assert adapter.keys() == start.keys() and len(adapter) == 2 * 7 * 2  # A and B, 7 projections, 2 blocks
    assert all(not torch.equal(adapter[k], start[k]) for k in adapter)  # every A and B moved
    export_pretrained(sft.model, tmp_path / "export")
    assert (tmp_path / "export" / "adapter_config.json").is_file()
    loaded = Transformer.from_pretrained(tmp_path / "base", adapter=tmp_path / "export").eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids()).logits, sft.model.eval()(ids()).logits, rtol=0, atol=0)
