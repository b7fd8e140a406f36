"""GRPO on a policy built on the meta device and read from a Hugging Face directory into its FSDP2 shards (a
one-rank mesh in this process): its rollouts, which decode on a plain copy made before the shards were filled,
and its loss are those of the policy read whole."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from fit_runs import free_port
from test_grpo import grpo, prompt_batch, varied

from astrai_pl.model import ModelConfig, Transformer
from astrai_pl.parallel import is_dtensor


@pytest.fixture
def one_rank():
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    strategy = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1)
    strategy._device_mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
    strategy.parallel_devices = [torch.device("cpu")]
    try:
        yield SimpleNamespace(strategy=strategy, global_step=0)
    finally:
        dist.destroy_process_group()


def test_grpo_on_a_meta_built_policy_rolls_out_and_trains_as_the_policy_read_whole(one_rank, tmp_path):
    torch.manual_seed(0)
    Transformer(ModelConfig.from_name("debug")).save_pretrained(tmp_path / "hf")
    kw = dict(init_from=str(tmp_path / "hf"), beta=0.0, reward_funcs=[varied], max_completion_length=8)
    plain, sharded = grpo(**kw), grpo(**kw, meta_init=True)
    assert all(p.is_meta for p in sharded.model.parameters())
    sharded._trainer = one_rank
    sharded.configure_model()
    assert all(is_dtensor(p) and not p.is_meta for p in sharded.model.parameters())
    batch = prompt_batch(2)
    ours, theirs = sharded.roll_out(batch, 2, seed=3), plain.roll_out(batch, 2, seed=3)
    assert ours.metrics["reward"] == theirs.metrics["reward"]
    for mine, other in zip(ours.micro_batches, theirs.micro_batches):
        assert torch.equal(mine["input_ids"], other["input_ids"])
        losses = [m._shared_step({**part, "first_pass": True}, "train")[0]
                  for m, part in ((sharded, mine), (plain, other))]
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)
