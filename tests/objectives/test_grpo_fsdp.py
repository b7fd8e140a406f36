"""GRPO under FSDP2 and tensor parallel on two CPU processes (gloo): rollouts decode on full weights gathered
from the shards into a plain copy (and freed after), training runs on the shards, and the per-step losses
equal those of the unsharded layouts (DDP for FSDP2, one process for tensor parallel)."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml
from fit_runs import ROOT, finish, free_port, mean_losses
from test_grpo import grpo, prompt_batch, varied

from astrai_pl.inference import Engine, SamplingParams
from astrai_pl.model import ModelConfig, Transformer
from astrai_pl.parallel import (
    apply_fsdp2,
    apply_tensor_parallel,
    gather_full_weights,
    is_dtensor,
    release_weights,
    weightless_copy,
)

GRPO_DEBUG = ROOT / "configs" / "grpo" / "debug.yaml"
HERE = Path(__file__).resolve().parent


# -- GRPO on FSDP2 shards in this process (a one-rank mesh) against the same GRPO unsharded ----------------
@pytest.fixture
def one_rank():
    """A one-process gloo group and an FSDP2 strategy over it, as Lightning would have set it up."""
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    strategy = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1)
    strategy._device_mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
    try:
        yield SimpleNamespace(strategy=strategy, global_step=0)
    finally:
        dist.destroy_process_group()


def test_grpo_rolls_out_on_gathered_weights_frees_them_and_trains_on_the_shards(one_rank):
    kw = dict(num_iterations=2, beta=0.1, reward_funcs=[varied], max_completion_length=8)
    plain, sharded = grpo(**kw), grpo(**kw)
    sharded._trainer = one_rank
    sharded.configure_model()
    assert all(is_dtensor(p) for p in [*sharded.model.parameters(), *sharded.ref_model.parameters()])
    batch = prompt_batch(2)
    ours, theirs = sharded.roll_out(batch, 2, seed=3), plain.roll_out(batch, 2, seed=3)
    assert all(p.numel() == 0 for p in sharded._rollout_model.parameters())  # freed after the rollout
    assert ours.metrics["reward"] == theirs.metrics["reward"]
    for mine, other in zip(ours.micro_batches, theirs.micro_batches):
        assert torch.equal(mine["input_ids"], other["input_ids"]) and torch.equal(mine["advantages"],
                                                                                  other["advantages"])
        for key in ("ref_logps", "old_logps", "rollout_logps"):
            torch.testing.assert_close(mine[key], other[key], rtol=1e-5, atol=1e-6)
        for module, part in ((sharded, mine), (plain, other)):
            part["loss"] = module._shared_step({**part, "first_pass": True}, "train")[0]
            part["loss"].backward()
        torch.testing.assert_close(mine["loss"], other["loss"], rtol=1e-5, atol=1e-6)
    grads = {n: p.grad.full_tensor() for n, p in sharded.model.named_parameters()}
    for name, param in plain.model.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, rtol=1e-4, atol=1e-6)
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    with torch.inference_mode():  # held-out evaluation, as Lightning runs it
        (ours, *_), (theirs, *_) = (m._sample_and_score(batch, greedy, 1) for m in (sharded, plain))
    assert [c.token_ids for c in ours] == [c.token_ids for c in theirs]


# -- the gather, on two processes ---------------------------------------------------------------------------
def _decode(model: Transformer, max_tokens: int) -> list[int]:
    engine = Engine(model, page_size=4, max_total_tokens=256)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return list(engine.generate([[5, 6, 7, 8]], params)[0].token_ids)


def _gather_rank(rank: int, world: int, port: int, results) -> None:
    """For each layout (FSDP2, tensor parallel): shard a debug model, gather it into a plain copy, decode a
    different length on each rank, then meet at a collective: the engine on the copy must have made none."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        for layout, apply, tied in (("data_parallel", apply_fsdp2, True),
                                    ("tensor_parallel", apply_tensor_parallel, False)):
            torch.manual_seed(0)
            model = Transformer(ModelConfig.from_name("debug", tie_word_embeddings=tied))
            full = {k: v.clone() for k, v in model.state_dict().items()}
            expected = _decode(model, 3 + 4 * rank)  # rank 1 decodes 4 more steps than rank 0
            copy = weightless_copy(model)
            apply(model, init_device_mesh("cpu", (world,), mesh_dim_names=(layout,)))
            sharded = all(is_dtensor(p) for p in model.parameters())
            gather_full_weights(model, copy)
            equal = sorted(k for k, v in copy.state_dict().items() if torch.equal(v, full[k])) == sorted(full)
            decoded = _decode(copy, 3 + 4 * rank)
            release_weights(copy)
            freed = all(p.numel() == 0 for p in copy.parameters()) and (copy.lm_head.weight is
                                                                        copy.embed_tokens.weight) == tied
            dist.barrier()
            results.put((layout, rank, sharded, equal, decoded == expected, freed))
    finally:
        dist.destroy_process_group()


# slow (make test-all): two spawned gloo processes, each importing the stack afresh
@pytest.mark.slow
def test_gathered_weights_equal_the_full_model_and_decode_without_collectives():
    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_gather_rank, args=(2, free_port(), results), nprocs=2)  # raises if a rank failed (gloo: 60 s)
    got = [results.get() for _ in range(4)]
    assert all(row[2:] == (True, True, True, True) for row in got), got  # sharded, equal, decoded, freed


# -- whole runs: DDP against FSDP2, one process against tensor parallel -------------------------------------
def grpo_config(folder: Path, *, devices: int, strategy, batch_size: int, max_steps: int = 4) -> Path:
    """configs/grpo/debug.yaml shortened: `max_steps` steps (two optimizer passes per rollout, two
    micro-batches each, the KL reference on), no validation, checkpoints or logger; the mean loss over
    ranks of every micro-batch in mean_loss.jsonl."""
    cfg = yaml.safe_load(GRPO_DEBUG.read_text())
    cfg["trainer"].update(accelerator="cpu", devices=devices, strategy=strategy, max_steps=max_steps,
                          limit_val_batches=0, val_check_interval=None, check_val_every_n_epoch=1, logger=False,
                          enable_checkpointing=False, enable_progress_bar=False, default_root_dir=".",
                          callbacks=[{"class_path": "fit_runs.MeanLoss"}])
    model = cfg["model"]["init_args"]
    model["scheduler"]["init_args"]["max_steps"] = max_steps
    model.update(reward_funcs=["test_grpo.varied"], reward_weights=None)  # siblings' rewards differ
    assert model["beta"] > 0 and model["num_iterations"] == 2 and cfg["trainer"]["accumulate_grad_batches"] == 2
    cfg["data"]["init_args"]["batch_size"] = batch_size
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def launch(config: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_PORT": str(free_port()),
           "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(HERE), os.environ.get("PYTHONPATH", "")])}
    log = open(config.parent / "run.log", "ab")
    cmd = [sys.executable, "-m", "astrai_pl.cli", "fit", "--config", str(config)]
    return subprocess.Popen(cmd, cwd=config.parent, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two 4-step runs (two rollouts) of 2 processes × 2 prompts (DDP, FSDP2), and one process × 2 prompts
    against tensor parallel over 2 processes (each holds the same 2 prompts), all started together."""
    settings = {
        "ddp": dict(devices=2, strategy="ddp", batch_size=2),
        "fsdp2": dict(devices=2, strategy="fsdp2", batch_size=2),
        "single": dict(devices=1, strategy="ddp", batch_size=2),  # ddp: the same DistributedSampler order as tp
        "tp": dict(devices=2, batch_size=2, strategy={"class_path": "astrai_pl.strategy.FSDP2Strategy",
                                                      "init_args": {"tensor_parallel_size": 2}}),
    }
    configs = {name: grpo_config(tmp_path_factory.mktemp(name), **kw) for name, kw in settings.items()}
    procs = {name: launch(config) for name, config in configs.items()}
    for proc in procs.values():
        finish(proc, timeout=500)
    return {name: mean_losses(config.parent) for name, config in configs.items()}


# slow (make test-all): four fit runs, seven processes started together, each importing the stack afresh
@pytest.mark.slow
@pytest.mark.parametrize("name, reference", [("fsdp2", "ddp"), ("tp", "single")])
def test_sharded_grpo_losses_equal_the_unsharded_run(runs, name, reference):
    # 4 steps × 2 micro-batches; a rollout's first pass has ratio 1 and zero-mean advantages (a loss near 0),
    # its second pass follows an optimizer step on the shards, and the second rollout decodes on its gather
    losses = runs[reference]
    assert len(losses) == 8 and abs(losses[2]) > 1e-3 and abs(losses[6]) > 1e-3
    torch.testing.assert_close(runs[name], runs[reference], rtol=1e-5, atol=1e-6)
