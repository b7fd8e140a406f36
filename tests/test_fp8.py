"""FP8 training (torchao's float8 linear layers): which layers convert, the refusal where no FP8 tensor cores exist
(CPU here), bad recipe names; the float8 arithmetic itself on torch's CPU float8 matmuls (the refusal lifted), alone
and under FSDP2 on a meta-device build; on a GPU of capability 8.9 or more, 50 steps within 1 % of bf16's loss."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from fit_runs import quiet_trainer

from astrai_pl import parallel
from astrai_pl.model import ConfigError, LoraConfig, ModelConfig, Transformer
from astrai_pl.objectives import SFT, Pretrain
from astrai_pl.parallel import FP8UnavailableError, check_fp8_device, convert_to_fp8
from astrai_pl.strategy import FSDP2Strategy


def _batches(n: int, seed: int = 1, vocab: int = 320, length: int = 32, device: str = "cpu"):
    ids = torch.randint(3, vocab, (n, 4, length), generator=torch.Generator().manual_seed(seed))
    return torch.utils.data.DataLoader([{"input_ids": x.to(device), "labels": x.to(device)} for x in ids],
                                       batch_size=None)


def test_fp8_is_refused_on_cpu_when_the_model_is_laid_out_with_the_reason_and_the_fix():
    module = Pretrain(arch=ModelConfig.from_name("debug"), fp8="tensorwise")  # a config is valid anywhere
    with pytest.raises(FP8UnavailableError, match=r"trains on cpu, which has no FP8 tensor cores .*; train on a GPU "
                                                  r"of compute capability 8\.9 or higher .* or set fp8: null"):
        quiet_trainer(max_steps=1).fit(module, train_dataloaders=_batches(1))
    assert all(type(m).__name__ != "Float8Linear" for m in module.model.modules())  # refused before converting
    with pytest.raises(FP8UnavailableError, match="no FP8 tensor cores"):
        check_fp8_device(torch.device("cpu"))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_conversion_skips_the_output_layer_and_dims_not_multiples_of_16(recipe):
    arch = ModelConfig.from_name("debug", intermediate_size=100)  # the MLP's 100 is no multiple of 16
    with torch.device("meta"):
        model = Transformer(arch)
    names = list(model.state_dict())
    converted = convert_to_fp8(model, recipe)
    kinds = {name: type(m).__name__ for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    projections = [f"layers.{i}.self_attn.{p}_proj" for i in range(2) for p in "qkvo"]
    assert sorted(converted) == sorted(projections)
    assert {n for n, kind in kinds.items() if kind == "Float8Linear"} == set(projections)
    assert kinds["lm_head"] == "Linear" and kinds["layers.0.mlp.gate_proj"] == "Linear"
    assert list(model.state_dict()) == names  # checkpoints and exports keep their keys
    scaling = model.layers[0].self_attn.q_proj.config.cast_config_weight.scaling_granularity.value
    assert scaling == {"tensorwise": "tensorwise", "rowwise": "axiswise"}[recipe]
    assert convert_to_fp8(model, recipe) == []  # configure_model runs again for validate/test


def test_bad_fp8_settings_are_refused_by_name_when_the_objective_is_built():
    with pytest.raises(ConfigError, match=r"fp8='e4m3': unknown FP8 recipe; use tensorwise .* rowwise .* or null"):
        Pretrain(arch=ModelConfig.from_name("debug"), fp8="e4m3")
    with pytest.raises(ConfigError, match=r"fp8='rowwise' with lora: .* drop one of them"):
        SFT(arch=ModelConfig.from_name("debug"), fp8="rowwise", lora=LoraConfig(r=4))
    with pytest.raises(ConfigError, match=r"fp8='tensorwise' with quantize"):
        SFT(arch=ModelConfig.from_name("debug"), fp8="tensorwise", lora=LoraConfig(r=4), quantize="nf4")


# -- the float8 arithmetic on torch's CPU float8 matmuls: slow, the same numbers a GPU's tensor cores give ---------
@pytest.fixture
def fp8_on_cpu(monkeypatch):
    monkeypatch.setattr(parallel, "check_fp8_device", lambda device: None)
    yield
    if torch.distributed.is_initialized():  # a one-rank FSDP2 run's group
        torch.distributed.destroy_process_group()


def _losses(fp8: str | None, strategy="auto", meta_init: bool = False, steps: int = 12) -> tuple[list[float], Pretrain]:
    """Losses of `steps` steps on one repeated batch (the model learns it, so the loss moves)."""
    torch.manual_seed(0)
    module = Pretrain(arch=ModelConfig.from_name("debug"), fp8=fp8, meta_init=meta_init)
    ids = torch.randint(3, 320, (4, 32), generator=torch.Generator().manual_seed(1))
    seen = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append(float(outputs["loss"]))

    trainer = quiet_trainer(devices=1, strategy=strategy, max_steps=steps, callbacks=[Record()])
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader([{"input_ids": ids, "labels": ids}] * steps,
                                                                      batch_size=None))
    return seen, module


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_layers_train_within_one_percent_of_fp32(fp8_on_cpu, recipe):
    (reference, _), (ours, module) = _losses(None), _losses(recipe)
    assert sum(type(m).__name__ == "Float8Linear" for m in module.model.modules()) == 14
    assert reference[-1] < 0.95 * reference[0]  # it learns (5.77 to 5.27): the comparison means something
    assert ours[-1] == pytest.approx(reference[-1], rel=0.01)


def test_fp8_composes_with_fsdp2_float8_all_gather_and_a_meta_build(fp8_on_cpu):
    (reference, _), (ours, module) = _losses(None, FSDP2Strategy(), True), _losses("tensorwise", FSDP2Strategy(), True)
    q_proj = module.model.layers[0].self_attn.q_proj
    assert type(q_proj).__name__ == "Float8Linear" and q_proj.config.enable_fsdp_float8_all_gather
    assert type(q_proj.weight).__name__ == "DTensor" and not q_proj.weight.is_meta
    assert module.trainer.optimizers[0]._optimizer_step_post_hooks  # the scales computed once after each step
    assert ours[-1] == pytest.approx(reference[-1], rel=0.01)


def _has_fp8_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.cuda
@pytest.mark.skipif(not _has_fp8_gpu(), reason="needs a GPU of compute capability 8.9 or higher")
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fifty_fp8_steps_stay_within_one_percent_of_bf16(recipe):
    arch = ModelConfig.from_name("debug", hidden_size=256, intermediate_size=512, num_attention_heads=8,
                                 num_key_value_heads=4, num_hidden_layers=4, vocab_size=1024)
    losses = {}
    for fp8 in (None, recipe):
        torch.manual_seed(0)
        module = Pretrain(arch=arch, fp8=fp8)
        trainer = quiet_trainer(accelerator="cuda", devices=1, max_steps=50, precision="bf16-mixed")
        trainer.fit(module, train_dataloaders=_batches(50, vocab=1024, length=128))
        losses[fp8] = float(trainer.callback_metrics["train/loss"])
        if fp8:
            assert any(type(m).__name__ == "Float8Linear" for m in module.model.modules())
    assert losses[recipe] == pytest.approx(losses[None], rel=0.01)

