"""Losses normalised by counts summed over the data-parallel ranks: two gloo processes with uneven batches (one
row on rank 0, three on rank 1, of different lengths) give, once their gradients are averaged as DDP does, the
gradients of one process that sees all four rows — for every objective that shares `accumulation_scale`."""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from fit_runs import free_port

from astrai_pl.model import ModelConfig
from astrai_pl.objectives import DPO, KTO, ORPO, SFT, RewardModel, SimPO
from astrai_pl.objectives.global_counts import rank_share, summed_over_ranks

ARCH = ModelConfig.from_name("debug", hidden_size=32, intermediate_size=64, num_hidden_layers=1, vocab_size=64)
WORLD = 2
ROWS = {0: slice(0, 1), 1: slice(1, 4)}  # uneven: 1 row on rank 0, 3 on rank 1
OBJECTIVES = {
    "sft": lambda: SFT(arch=ARCH),
    "dpo": lambda: DPO(arch=ARCH),
    "dpo_rpo_alpha": lambda: DPO(arch=ARCH, rpo_alpha=0.5),
    "orpo": lambda: ORPO(arch=ARCH),
    "simpo": lambda: SimPO(arch=ARCH),
    "reward": lambda: RewardModel(arch=ARCH, center_rewards_coefficient=0.01),
    "kto": lambda: KTO(arch=ARCH, loss_type="apo_zero_unpaired"),
}


def _padded(rows: list[tuple[list[int], list[int]]], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt, completion) rows right-padded to `width`: ids (B, T) and labels (B, T), -100 off the completion."""
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.full((len(rows), width), -100)
    for i, (prompt, completion) in enumerate(rows):
        n = len(prompt) + len(completion)
        ids[i, :n] = torch.tensor(prompt + completion)
        labels[i, len(prompt):n] = torch.tensor(completion)
    return ids, labels


def batches() -> dict[str, dict[str, torch.Tensor]]:
    """Four rows of each objective's batch layout, with prompts and responses of different lengths."""
    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(1, 64, (n,), generator=g).tolist()  # noqa: E731
    prompts = [ids(n) for n in (3, 5, 2, 4)]
    chosen, rejected = [ids(n) for n in (9, 2, 6, 3)], [ids(n) for n in (4, 7, 2, 5)]
    c_ids, c_labels = _padded(list(zip(prompts, chosen)), 16)
    r_ids, r_labels = _padded(list(zip(prompts, rejected)), 16)
    pairs = {"chosen_input_ids": c_ids, "chosen_labels": c_labels, "rejected_input_ids": r_ids,
             "rejected_labels": r_labels, "prompt_lengths": torch.tensor([len(p) for p in prompts]),
             "row_index": torch.arange(4)}
    return {"tokens": {"input_ids": c_ids, "labels": c_labels}, "pairs": pairs,
            "examples": {"input_ids": r_ids, "labels": r_labels, "label": torch.tensor([True, False, True, False])}}


def layout(name: str) -> str:
    return {"sft": "tokens", "kto": "examples"}.get(name, "pairs")


def gradients(name: str, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The flat gradient of the objective's training loss on `batch`, from the same initial weights."""
    torch.manual_seed(0)
    module = OBJECTIVES[name]().train()
    with torch.no_grad():  # policy != reference: DPO's and KTO's losses are not at their flat point
        module.model.lm_head.weight.add_(0.05 * torch.randn_like(module.model.lm_head.weight))
    loss, _ = module._shared_step(batch, "train")
    loss.backward()
    return torch.cat([p.grad.flatten() for p in module.model.parameters() if p.grad is not None])


def _rank(rank: int, port: int, folder: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))
    try:
        data = batches()
        out = {}
        for name in OBJECTIVES:
            grad = gradients(name, {k: v[ROWS[rank]] for k, v in data[layout(name)].items()})
            dist.all_reduce(grad)  # DDP: the average of the ranks' gradients
            out[name] = grad / WORLD
        count, ranks = summed_over_ranks(torch.tensor(rank + 1))
        out["counts"] = (int(count), ranks, float(rank_share(rank + 1, torch.device("cpu"))))
        if rank == 0:
            torch.save(out, f"{folder}/rank0.pt")
    finally:
        dist.destroy_process_group()


def test_two_uneven_ranks_give_the_gradients_of_one_process_on_both_batches(tmp_path):
    context = mp.spawn(_rank, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=False)
    data = batches()
    single = {name: gradients(name, data[layout(name)]) for name in OBJECTIVES}
    # Each rank normalising by its own count (one process per rank, no group): a mean of per-rank means.
    per_rank_means = {name: sum(gradients(name, {k: v[rows] for k, v in data[layout(name)].items()})
                                for rows in ROWS.values()) / WORLD for name in OBJECTIVES}
    while not context.join():  # raises if a rank failed (gloo: 60 s)
        pass
    got = torch.load(tmp_path / "rank0.pt", weights_only=True)
    assert got["counts"] == (3, 2, pytest.approx(2 * 1 / 3))
    for name in OBJECTIVES:
        torch.testing.assert_close(got[name], single[name], rtol=1e-4, atol=1e-6, msg=name)
        assert not torch.allclose(per_rank_means[name], single[name], rtol=1e-2, atol=1e-5), name  # uneven
