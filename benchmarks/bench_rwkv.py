"""RWKV training steps: our model (the fused WKV kernel) against transformers' RwkvForCausalLM and against
our own PyTorch loop over time, on the same weights, on CPU.

The `rwkv-tiny` preset (4 layers, width 192, float32, 2 threads), written with `save_pretrained` and read
back by transformers (whose CPU path runs the recurrence as a Python loop over time). A step is a forward
over (batch, T) random ids, the mean cross-entropy of the next token, and the backward; T = 256 and 1024.
The loop row runs the same model with the CPU kernels off (`override_available(False)`: the recurrence as a
loop of PyTorch ops, everything else unchanged). Repetitions alternate (harness.py).

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_rwkv.py
"""

from __future__ import annotations

import argparse
import functools
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import command_line, duel, emit, row_from, save, setup  # noqa: E402

from astrai_pl.model import ModelConfig, Transformer  # noqa: E402
from astrai_pl.ops import cpu  # noqa: E402


def next_token_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="256,1024", help="comma-separated sequence lengths, one row each")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--budget", type=float, default=120, help="seconds after which no new round starts")
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args()
    setup(args.threads)
    import transformers

    torch.manual_seed(0)
    ours = Transformer(ModelConfig.from_name("rwkv-tiny")).train()
    with tempfile.TemporaryDirectory() as folder:
        ours.save_pretrained(folder)
        peer = transformers.RwkvForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).train()

    def step_ours(ids):
        ours.zero_grad(set_to_none=True)
        next_token_loss(ours(ids).logits, ids).backward()

    def step_loop(ids):
        with cpu.override_available(False):
            step_ours(ids)

    def step_peer(ids):
        peer.zero_grad(set_to_none=True)
        next_token_loss(peer(ids).logits, ids).backward()

    rows = []
    for T in map(int, args.lengths.split(",")):
        ids = torch.randint(3, ours.config.vocab_size, (args.batch, T))
        tokens = args.batch * T
        for name, peer_step in (("transformers RwkvForCausalLM (CPU loop)", step_peer),
                                ("our PyTorch loop over time", step_loop)):
            peer_step(ids)  # warm-up, both
            step_ours(ids)
            result = duel(functools.partial(step_ours, ids), functools.partial(peer_step, ids), args.repeats,
                          warmup=0, budget_s=args.budget)
            rows.append(row_from(result, f"RWKV train step (rwkv-tiny, {args.batch} x {T} tokens)", name,
                                 tokens, "tokens/s", command_line()))
            emit(rows[-1:])
    save(rows, args.json)


if __name__ == "__main__":
    main()
