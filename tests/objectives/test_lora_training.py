"""LoRA runs under each training layout of one process: activation checkpointing (full, selective), compile and
bf16-mixed. The frozen base stays bit for bit what init_from holds, the adapter moves, the loss is finite, and the
adapter's gradients are those of the plain layout. A LoRA run's Hugging Face export is its PEFT adapter."""

from __future__ import annotations

import copy
import functools
import math

import lightning as L
import pytest
import torch
from fit_runs import quiet_trainer

from astrai_pl import parallel
from astrai_pl.callbacks.export import export_pretrained
from astrai_pl.model import LoraConfig, ModelConfig, Transformer
from astrai_pl.model.lora import adapter_state, apply_lora
from astrai_pl.objectives import Pretrain
from astrai_pl.parallel import apply_activation_checkpointing, compile_blocks

LORA = dict(r=4, lora_alpha=8, target_modules="all-linear")


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("base") / "hf"
    Transformer(ModelConfig.from_name("debug")).save_pretrained(folder)
    return folder


class _Batches(L.LightningDataModule):
    def train_dataloader(self):
        ids = torch.randint(3, 320, (3, 2, 32), generator=torch.Generator().manual_seed(1))
        return torch.utils.data.DataLoader([{"input_ids": x, "labels": x} for x in ids], batch_size=None)


def _aot_eager_compile(monkeypatch):
    """compile: true with dynamo's aot_eager backend: inductor's C++ build is too slow for the CPU suite."""
    monkeypatch.setattr(parallel, "compile_blocks", functools.partial(compile_blocks, backend="aot_eager"))


LAYOUTS = {
    "plain": ({}, "32-true"),
    "full-checkpointing": ({"activation_checkpointing": "full"}, "32-true"),
    "selective-checkpointing": ({"activation_checkpointing": "selective"}, "32-true"),
    "compile": ({"compile": True}, "32-true"),
    "bf16-mixed": ({}, "bf16-mixed"),
}


@pytest.mark.parametrize("layout", [pytest.param(name, marks=[pytest.mark.slow] if name == "compile" else [])
                                    for name in LAYOUTS])  # compile's gradients are checked fast below
def test_a_lora_run_trains_the_adapter_and_leaves_the_base_bit_for_bit(base_dir, layout, monkeypatch):
    options, precision = LAYOUTS[layout]
    if options.get("compile"):
        _aot_eager_compile(monkeypatch)
    torch.manual_seed(0)
    module = Pretrain(init_from=str(base_dir), lora=LoraConfig(**LORA), **options)
    start = {k: v.clone() for k, v in adapter_state(module.model).items()}
    trainer = quiet_trainer(devices=1, max_steps=3, precision=precision)
    trainer.fit(module, datamodule=_Batches())

    if options.get("compile"):
        assert all(block._compiled_call_impl is not None for block in module.model.layers)
    state = module.model.state_dict()
    base = Transformer.from_pretrained(base_dir).state_dict()
    assert all(torch.equal(state[k], v) for k, v in base.items())  # the frozen base, bit for bit
    adapter = adapter_state(module.model)
    assert adapter.keys() == start.keys() and len(adapter) == 28
    assert all(not torch.equal(adapter[k], start[k]) for k in adapter)  # every A and B moved
    assert math.isfinite(float(trainer.callback_metrics["train/loss"]))
    assert all(p.dtype == torch.float32 for p in module.model.parameters())  # bf16-mixed: autocast, fp32 weights


def _adapter_gradients(model, ids):
    loss = model(ids).logits.float().logsumexp(-1).mean()
    loss.backward()
    assert all(p.grad is None for n, p in model.named_parameters() if ".lora_" not in n)  # base frozen
    return {n: p.grad for n, p in model.named_parameters() if ".lora_" in n}


def _adapted_model(layers: int = 2, base: Transformer | None = None) -> Transformer:
    """`base` (else a debug model) with an all-linear adapter whose B is not zero (under B = 0, A gets no
    gradient)."""
    torch.manual_seed(0)
    model = base or Transformer(ModelConfig.from_name("debug", num_hidden_layers=layers))
    apply_lora(model, LoraConfig(**LORA))
    for name, p in model.named_parameters():
        if ".lora_B." in name:
            torch.nn.init.normal_(p, std=0.02)
    return model


IDS = torch.randint(0, 320, (2, 16), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_adapter_gradients_under_activation_checkpointing_are_the_plain_ones_bit_for_bit(mode):
    model = _adapted_model()
    plain = _adapter_gradients(copy.deepcopy(model), IDS)
    assert len(plain) == 28 and all(g.abs().max() > 0 for g in plain.values())
    apply_activation_checkpointing(model, mode)
    grads = _adapter_gradients(model, IDS)
    assert all(torch.equal(grads[k], plain[k]) for k in plain)  # the same ops replayed


def test_compiled_adapter_gradients_equal_the_eager_ones():
    model = _adapted_model(layers=1)  # one block: compiling is what this test costs
    plain = _adapter_gradients(copy.deepcopy(model), IDS)
    compile_blocks(model, backend="aot_eager")
    grads = _adapter_gradients(model, IDS)
    assert len(plain) == 14 and all(g.abs().max() > 0 for g in plain.values())
    for key in plain:  # traced graphs may sum in another order: equal to float32 rounding
        torch.testing.assert_close(grads[key], plain[key], rtol=1e-5, atol=1e-7)


def test_the_hf_export_of_a_lora_model_is_its_peft_adapter(base_dir, tmp_path):
    model = _adapted_model(base=Transformer.from_pretrained(base_dir))
    apply_activation_checkpointing(model, "full")  # a layout as training leaves it
    export_pretrained(model, tmp_path / "export")
    assert (tmp_path / "export" / "adapter_config.json").is_file()
    assert not (tmp_path / "export" / "model.safetensors").exists()  # the base is init_from's, not copied
    loaded = Transformer.from_pretrained(base_dir, adapter=tmp_path / "export")
    with torch.no_grad():
        torch.testing.assert_close(loaded(IDS).logits, model(IDS).logits, rtol=0, atol=0)
