"""One process of tests/test_meta_init.py: `python meta_runs.py whole|sharded OUT [HF_DIR]`; `sharded` runs as one
rank of a gloo group (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the environment).

`whole` builds BIG in host memory, as every rank did before meta-device builds. `sharded` builds BIG on the meta
device and lays it out with FSDP2 through the objective's own configure_model, then does the same for the debug model
(its gathered weights saved) and for HF_DIR (the logits of IDS saved). Each writes the growth of its peak resident
memory over the build of BIG (VmHWM after, less VmRSS before, the peak reset before; a debug model built first, so
that imports and caches are not counted) into OUT/rss-MODE-RANK.json."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from astrai_pl.model import ModelConfig
from astrai_pl.objectives import Pretrain
from astrai_pl.strategy import FSDP2Strategy

# 16 blocks of 4.2 M parameters: 268 MB of float32 weights, no block over 1/16 of them
BIG = dict(hidden_size=512, intermediate_size=2048, num_attention_heads=8, num_key_value_heads=8,
           num_hidden_layers=16)
IDS = torch.randint(3, 320, (2, 24), generator=torch.Generator().manual_seed(3))


def memory_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


class Layout(FSDP2Strategy):
    """FSDP2Strategy over a mesh made here, without a Trainer around it: what the objective's configure_model reads."""

    def __init__(self, mesh):
        super().__init__()
        self._device_mesh = mesh

    @property
    def root_device(self) -> torch.device:
        return torch.device("cpu")

    def broadcast(self, obj, src: int = 0):
        box = [obj]
        torch.distributed.broadcast_object_list(box, src)
        return box[0]


def sharded_objective(mesh, **kwargs) -> Pretrain:
    with torch.device("meta"):  # what trainer.init_module(empty_init=True) does under FSDP2
        module = Pretrain(**kwargs)
    module._trainer = type("Trainer", (), {"strategy": Layout(mesh)})()
    module.configure_model()
    return module


def main(mode: str, out: Path, hf_dir: str | None = None) -> None:
    torch.manual_seed(0)
    rank = int(os.environ.get("RANK", 0))
    mesh = None
    if mode == "sharded":
        from torch.distributed.device_mesh import init_device_mesh

        torch.distributed.init_process_group("gloo")
        mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
    warm = ModelConfig.from_name("debug")  # imports and caches first, so that what is measured is the weights
    Pretrain(arch=warm) if mesh is None else sharded_objective(mesh, arch=warm)
    Path("/proc/self/clear_refs").write_text("5")  # the peak starts again from here
    before = memory_kb("VmRSS")
    big = Pretrain(arch=ModelConfig.from_name("debug", **BIG)) if mesh is None else sharded_objective(
        mesh, arch=ModelConfig.from_name("debug", **BIG))
    growth = memory_kb("VmHWM") - before
    held = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in big.model.parameters())
    (out / f"rss-{mode}-{rank}.json").write_text(json.dumps({"growth_kb": growth, "held": held}))
    del big
    if mesh is None:
        return
    fresh = sharded_objective(mesh, arch=ModelConfig.from_name("debug"))
    weights = {k: p.full_tensor() for k, p in fresh.model.named_parameters()}
    loaded = sharded_objective(mesh, init_from=hf_dir)
    with torch.no_grad():
        logits = loaded.model(IDS).logits
    if rank == 0:
        torch.save({"weights": weights, "logits": logits}, out / "sharded.pt")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), *sys.argv[3:])
