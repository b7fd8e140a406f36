"""dapo's normalisation over the whole optimizer step: micro-batches accumulated as Lightning does, and two
data-parallel ranks (gloo on the CPU) averaged as DDP does, give the gradient of one batch of every completion."""

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from astrai_pl.inference import Completion
from astrai_pl.model import ModelConfig
from astrai_pl.objectives import GRPO
from astrai_pl.objectives.rollout import micro_batches
from astrai_pl.tokenizer import Tokenizer

G = 4  # completions per prompt


def module() -> GRPO:
    torch.manual_seed(0)
    return GRPO(arch=ModelConfig.from_name("debug"), tokenizer=Tokenizer.byte_level(), beta=0.0, loss_type="dapo",
                num_generations=G, max_completion_length=8,
                vllm_importance_sampling_correction=False).double()  # the engine log-probs here are made up


def rollout(seed: int, prompts: int = 2):
    """Prompt ids, G completions per prompt of uneven lengths (1..8 tokens), and their advantages."""
    gen = torch.Generator().manual_seed(seed)
    prompt_ids = [torch.randint(8, 200, (int(torch.randint(3, 7, (1,), generator=gen)),), generator=gen).tolist()
                  for _ in range(prompts)]
    completions = []
    for p in prompt_ids:
        for j in range(G):
            n = int(torch.randint(1, 9, (1,), generator=gen))
            ids = torch.randint(8, 200, (n,), generator=gen).tolist()
            completions.append(Completion(ids, "", "stop", [-1.0] * n, p, 0, index=j))
    return prompt_ids, completions, torch.randn(len(completions), generator=gen, dtype=torch.float64)


def accumulated_grads(grpo: GRPO, prompt_ids, completions, advantages, k: int) -> torch.Tensor:
    """Σ over k micro-batches of ∇(loss / k), as Lightning accumulates them."""
    grpo.zero_grad()
    for part in micro_batches(prompt_ids, completions, advantages, k, 0, "dapo"):
        (grpo._shared_step(part, "train")[0] / k).backward()
    return torch.cat([p.grad.flatten() for p in grpo.model.parameters()])


def test_dapo_micro_batches_add_up_to_one_batch_of_every_token():
    grpo = module()
    prompt_ids, completions, advantages = rollout(0, prompts=2)
    assert len({len(c.token_ids) for c in completions}) > 2  # a mean of micro-batch means would differ
    torch.testing.assert_close(accumulated_grads(grpo, prompt_ids, completions, advantages, 4),
                               accumulated_grads(grpo, prompt_ids, completions, advantages, 1), atol=1e-12, rtol=1e-9)
    tokens = sum(len(c.token_ids) for c in completions)
    assert micro_batches(prompt_ids, completions, advantages, 4, 0, "dapo")[0]["num_items"] == tokens / 4


def test_bnpo_is_the_mean_of_micro_batch_token_means():
    """TRL's bnpo normalises by the tokens of each local batch, so it is not the one-batch mean: on purpose."""
    grpo = module()
    grpo.hparams.loss_type = "bnpo"
    prompt_ids, completions, advantages = rollout(0, prompts=3)
    parts = micro_batches(prompt_ids, completions, advantages, 3, 0, "bnpo")
    assert [p["weight"] for p in parts] == [1.0] * 3 and all("num_items" not in p for p in parts)
    with torch.no_grad():
        losses = [grpo._shared_step(p, "train")[0] for p in parts]
    for part, loss in zip(parts, losses):  # ρ = 1 on a first pass: −mean A over the micro-batch's tokens
        m = part["mask"]
        expected = -(part["advantages"][:, None] * m).sum() / m.sum()
        torch.testing.assert_close(loss, expected.to(loss.dtype), atol=1e-6, rtol=1e-6)


def _rank(rank: int, world: int, port: int, results) -> None:
    """One DDP rank: its own prompts, the window's token count summed over ranks, gradients averaged."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        grpo = module()
        prompt_ids, completions, advantages = rollout(rank + 1, prompts=1 + rank)  # uneven token counts
        grads = accumulated_grads(grpo, prompt_ids, completions, advantages, 2)
        dist.all_reduce(grads)
        grads /= world  # DDP averages the ranks' gradients
        gathered = [None] * world
        dist.all_gather_object(gathered, (prompt_ids, completions, advantages))
    finally:
        dist.destroy_process_group()
    if rank == 0:  # one process, one batch of every rank's completions
        every = [sum((g[i] for g in gathered), []) for i in range(2)]
        one_batch = accumulated_grads(grpo, *every, torch.cat([g[2] for g in gathered]), 1)
        results.put((grads, one_batch))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# slow (make test-all): two spawned gloo processes; the one-process equality above stays in `make test`
@pytest.mark.slow
def test_dapo_under_two_ddp_ranks_equals_one_batch_of_both():
    ctx = mp.get_context("spawn")
    results, port = ctx.Queue(), free_port()
    ranks = [ctx.Process(target=_rank, args=(r, 2, port, results)) for r in range(2)]
    for p in ranks:
        p.start()
    try:
        grads, one_batch = results.get(timeout=240)
    finally:
        for p in ranks:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in ranks)
    torch.testing.assert_close(grads, one_batch, atol=1e-12, rtol=1e-9)
