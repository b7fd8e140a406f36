"""Layouts for training (activation checkpointing, compile, precision) on one process, and DDP / FSDP2 /
tensor parallel on two CPU processes (gloo) against the single-process run."""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import lightning as L
import pytest
import torch
from fit_runs import (
    ROOT,
    debug_config,
    final_weights,
    finish,
    free_port,
    launch,
    mean_losses,
    quiet_trainer,
    write_corpus,
)
from lightning.pytorch.plugins.precision import MixedPrecision
from torch.utils._python_dispatch import TorchDispatchMode

from astrai_pl.checkpoint import load_transformer
from astrai_pl.cli import lightning_main
from astrai_pl.model import ModelConfig, Transformer
from astrai_pl.objectives import Pretrain
from astrai_pl.ops import cpu as cpu_ops
from astrai_pl.parallel import apply_activation_checkpointing, check_tensor_parallel, compile_blocks
from astrai_pl.strategy import FSDP2Strategy, ParallelConfigError


class OpCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.__name__] = self.counts.get(func.__name__, 0) + 1
        return func(*args, **(kwargs or {}))


def _backward(model, ids):
    loss = model(ids).logits.float().logsumexp(-1).mean()
    with OpCount() as ops:
        loss.backward()
    return {k: p.grad for k, p in model.named_parameters()}, ops.counts


# -- activation checkpointing and compile ------------------------------------------------------------------
@pytest.mark.parametrize("kernels", [False, None], ids=["eager-pointwise", "fused-cpu-kernels"])
def test_activation_checkpointing_gives_equal_gradients_and_recomputes_what_its_policy_says(kernels):
    torch.manual_seed(0)
    base = Transformer(ModelConfig.from_name("debug"))
    ids = torch.randint(0, 320, (2, 16))
    results = {}
    with cpu_ops.override_available(kernels):
        for mode in ("none", "full", "selective"):
            model = copy.deepcopy(base)
            apply_activation_checkpointing(model, mode)
            results[mode] = _backward(model, ids)
    grads, ops = results["none"]
    for mode in ("full", "selective"):
        assert all(torch.equal(grads[k], results[mode][0][k]) for k in grads), mode
    # full replays each block's forward (its matmuls too); selective replays only the pointwise ops
    assert results["full"][1]["mm.default"] > ops["mm.default"]
    assert results["selective"][1]["mm.default"] == ops["mm.default"]
    if kernels is False:  # the fused kernels are no aten ops: only the eager pointwise ops can be counted
        assert results["selective"][1].get("silu.default", 0) > ops.get("silu.default", 0)


def test_activation_checkpointing_keeps_names_copies_and_is_idempotent():
    model = Transformer(ModelConfig.from_name("debug"))
    names = list(model.state_dict())
    apply_activation_checkpointing(model, "selective")
    apply_activation_checkpointing(model, "selective")  # configure_model runs again for validate/test
    assert list(model.state_dict()) == names and model.layers[0].checkpointing == "selective"
    twin = copy.deepcopy(model)
    assert twin.layers[0].self_attn is not model.layers[0].self_attn
    with pytest.raises(ParallelConfigError, match="already use 'selective'"):
        apply_activation_checkpointing(model, "full")
    with pytest.raises(ParallelConfigError, match=r"activation_checkpointing='some'.*none, full, selective"):
        Pretrain(arch=ModelConfig.from_name("debug"), activation_checkpointing="some")


def test_compiled_blocks_match_eager():
    torch.manual_seed(0)
    eager = Transformer(ModelConfig.from_name("debug"))
    compiled = copy.deepcopy(eager)
    compile_blocks(compiled, backend="aot_eager")  # inductor's C++ build is too slow for the CPU suite
    ids = torch.randint(0, 320, (2, 16))
    (g_eager, _), (g_compiled, _) = _backward(eager, ids), _backward(compiled, ids)
    torch.testing.assert_close(compiled(ids).logits, eager(ids).logits)
    for name in g_eager:
        torch.testing.assert_close(g_compiled[name], g_eager[name], rtol=1e-5, atol=1e-6)
    assert list(compiled.state_dict()) == list(eager.state_dict())


@pytest.mark.cuda
def test_inductor_compiled_blocks_match_eager_on_gpu():
    torch.manual_seed(0)
    eager = Transformer(ModelConfig.from_name("debug")).cuda()
    compiled = copy.deepcopy(eager)
    compile_blocks(compiled)
    ids = torch.randint(0, 320, (2, 64), device="cuda")
    (g_eager, _), (g_compiled, _) = _backward(eager, ids), _backward(compiled, ids)
    torch.testing.assert_close(compiled(ids).logits, eager(ids).logits, rtol=1e-4, atol=1e-4)
    for name in g_eager:
        torch.testing.assert_close(g_compiled[name], g_eager[name], rtol=1e-3, atol=1e-5)


# -- precision -------------------------------------------------------------------------------------------
class _Batches(L.LightningDataModule):
    def train_dataloader(self):
        torch.manual_seed(1)
        ids = torch.randint(3, 320, (6, 2, 32))
        return torch.utils.data.DataLoader([{"input_ids": x, "labels": x} for x in ids], batch_size=None)


def _fit_two_steps(module, **trainer_args):
    trainer = quiet_trainer(devices=1, max_steps=2, **trainer_args)
    trainer.fit(module, datamodule=_Batches())
    return trainer


def test_fp16_grad_scaler_clips_after_unscaling():
    """GradScaler multiplies the loss by 2**16; a clip threshold only means something on the real gradients."""
    torch.manual_seed(0)
    module = Pretrain(arch=ModelConfig.from_name("debug"))
    seen = []

    def record(optimizer, args, kwargs):
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        seen.append(float(torch.linalg.vector_norm(torch.stack([g.float().norm() for g in grads]))))

    class Hook(L.Callback):
        def on_fit_start(self, trainer, pl_module):
            trainer.optimizers[0].register_step_pre_hook(record)

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    _fit_two_steps(
        module,
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
        gradient_clip_val=0.05,
        callbacks=[Hook()],
    )
    assert seen, "the optimizer never stepped (every step overflowed)"
    for norm in seen:  # clipped real gradients: at the threshold, not 2**16 times below it
        assert norm == pytest.approx(0.05, rel=1e-2)


def test_bf16_mixed_trains_close_to_fp32():
    losses = {}
    for precision in ("32-true", "bf16-mixed"):
        torch.manual_seed(0)
        module = Pretrain(arch=ModelConfig.from_name("debug"))
        trainer = _fit_two_steps(module, precision=precision)
        losses[precision] = float(trainer.callback_metrics["train/loss"])
    assert losses["bf16-mixed"] == pytest.approx(losses["32-true"], rel=2e-2)


# -- the strategy ----------------------------------------------------------------------------------------
def test_fsdp2_is_a_strategy_name_in_yaml_and_on_the_command_line():
    cli = lightning_main(
        [
            "--config",
            str(ROOT / "configs/pretrain/debug.yaml"),
            "--trainer.accelerator",
            "cpu",
            "--trainer.strategy",
            "fsdp2",
            "--trainer.logger",
            "false",
        ],
        run=False,
    )
    assert isinstance(cli.trainer.strategy, FSDP2Strategy)


def test_parallel_settings_are_checked_with_the_fix():
    with pytest.raises(ParallelConfigError, match=r"param_dtype='bf16'.*bfloat16"):
        FSDP2Strategy(param_dtype="bf16")
    with pytest.raises(ParallelConfigError, match=r"does not divide ModelConfig.num_key_value_heads=2"):
        check_tensor_parallel(ModelConfig.from_name("debug"), 4)
    with pytest.raises(ParallelConfigError, match="MoE"):
        check_tensor_parallel(ModelConfig.from_name("debug", num_experts=4), 2)


# -- two processes on CPU --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Four 4-step runs on the same data, started together: one process with batch 8; two processes with
    batch 4 each under DDP and FSDP2 (the same global batch); tensor parallel over two processes. Then
    FSDP2 again from its sharded step-2 checkpoint, saving full checkpoints."""
    corpus = write_corpus(tmp_path_factory.mktemp("corpus") / "corpus.txt")
    probe = [{"class_path": "fit_runs.MeanLoss"}]
    settings = {
        "single": dict(batch_size=8),
        "ddp": dict(batch_size=4, strategy="ddp", devices=2),
        "fsdp2": dict(batch_size=4, strategy="fsdp2", devices=2, save_top_k=-1),
        "tp": dict(
            batch_size=8,
            devices=2,
            strategy={
                "class_path": "astrai_pl.strategy.FSDP2Strategy",
                "init_args": {"tensor_parallel_size": 2},
            },
        ),
    }
    qwen3 = {"model_type": "qwen3", "qk_norm": True}  # q/k norms act per head: sharded under TP
    common = dict(max_steps=4, extra_callbacks=probe, arch=qwen3)
    configs = {
        name: debug_config(tmp_path_factory.mktemp(name), corpus, **common, **kw)
        for name, kw in settings.items()
    }
    procs = {name: launch(config) for name, config in configs.items()}
    for proc in procs.values():
        finish(proc)
    resumed = debug_config(
        tmp_path_factory.mktemp("resumed"),
        corpus,
        **common,
        batch_size=4,
        devices=2,
        strategy={
            "class_path": "astrai_pl.strategy.FSDP2Strategy",
            "init_args": {"save_distributed_checkpoint": False},
        },
    )
    sharded = configs["fsdp2"].parent / "ckpt" / "epoch=0-step=2.ckpt"
    finish(launch(resumed, "--ckpt_path", str(sharded)))
    return {name: config.parent for name, config in {**configs, "resumed": resumed}.items()}


@pytest.mark.parametrize("name", ["ddp", "fsdp2", "tp"])
def test_two_processes_match_one(runs, name):
    torch.testing.assert_close(mean_losses(runs[name]), mean_losses(runs["single"]), rtol=1e-5, atol=1e-6)
    reference, weights = final_weights(runs["single"]), final_weights(runs[name])
    for key in reference:
        torch.testing.assert_close(weights[key], reference[key], rtol=1e-4, atol=1e-5)


def test_fsdp2_resumes_from_a_sharded_checkpoint_and_saves_a_full_one(runs):
    sharded = runs["fsdp2"] / "ckpt" / "epoch=0-step=2.ckpt"
    assert sharded.is_dir() and (sharded / "meta.pt").is_file() and (sharded / ".metadata").is_file()
    assert not list((runs["fsdp2"] / "ckpt").glob(".*partial*"))  # written aside, then renamed
    assert mean_losses(runs["resumed"]) == mean_losses(runs["fsdp2"])[2:]  # steps 3 and 4, bit for bit
    uninterrupted, resumed = final_weights(runs["fsdp2"]), final_weights(runs["resumed"])
    assert all(torch.equal(uninterrupted[k], resumed[k]) for k in uninterrupted)
    full = runs["resumed"] / "ckpt" / "last.ckpt"
    assert full.is_file()  # save_distributed_checkpoint=False: one file that loads anywhere
    model = load_transformer(None, str(full))
    hf = Transformer.from_pretrained(runs["resumed"] / "hf" / "final")
    for key, value in hf.state_dict().items():
        assert torch.equal(model.state_dict()[key], value)
    final_sharded = load_transformer(
        None, str(runs["fsdp2"] / "ckpt" / "last.ckpt")
    )  # gathered in one process
    for key, value in hf.state_dict().items():
        assert torch.equal(final_sharded.state_dict()[key], value)


def test_the_documented_fsdp2_command_runs(tmp_path):
    """`astrai-pl fit --config configs/pretrain/debug.yaml --trainer.accelerator cpu --trainer.devices 2
    --trainer.strategy fsdp2`, on a small corpus so the suite stays quick."""
    corpus = write_corpus(tmp_path / "corpus.txt")
    cmd = [
        sys.executable,
        "-m",
        "astrai_pl.cli",
        "fit",
        "--config",
        str(ROOT / "configs/pretrain/debug.yaml"),
        "--trainer.accelerator",
        "cpu",
        "--trainer.devices",
        "2",
        "--trainer.strategy",
        "fsdp2",
        "--data.init_args.path",
        str(corpus),
        "--trainer.enable_progress_bar",
        "false",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_PORT": str(free_port())}
    result = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "max_steps=8" in result.stdout + result.stderr
    assert (tmp_path / "runs/pretrain-debug/version_0/checkpoints/last.ckpt/meta.pt").is_file()  # sharded by default
    assert not (tmp_path / "runs/pretrain-debug/version_1").exists()  # the launched rank shares rank 0's directory
