"""A training step against transformers' LlamaForCausalLM and litgpt's GPT on the same weights, on CPU.

The `small` preset (hidden 512, 8 layers, 8 query / 2 key-value heads, vocab 8192, ~31M parameters),
batch 4 x 256 tokens, 2 threads. A step is forward, next-token cross-entropy, backward and AdamW
(torch's fused AdamW, lr 3e-4, the same on every side):

- ours: the loss of our `Pretrain` objective (`Objective.next_token_loss`: the model's hidden states,
  then the lm_head fused with the cross-entropy, `astrai_pl.objectives.losses.linear_cross_entropy`);
- transformers: `LlamaForCausalLM(input_ids=…, labels=…).loss` (its own shift and loss);
- litgpt: `GPT(input_ids)` → `litgpt.utils.chunked_cross_entropy`, as its pretraining script does.

The peers get our weights through our Hugging Face export (litgpt through its own converter), and the
largest logit difference to ours is printed as evidence. Precisions: 32-true, and bf16-mixed
(`torch.autocast("cpu", torch.bfloat16)` around each forward, as Lightning's and litgpt's bf16-mixed
do). MFU: model FLOPs per step (6·N + 12·L·d·T per token, N = the matmul parameters) over the step
time, against the peak of a 2048³ `torch.mm` measured here in the same dtype.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_step.py
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (  # noqa: E402
    Row,
    command_line,
    duels,
    emit,
    hf_copy,
    max_logit_gap,
    row_from,
    save,
    setup,
    small_model,
)

PEERS_DIR = Path(__file__).resolve().parents[1] / ".venv" / "peers"  # where `make bench` puts litgpt
LITGPT_WHY = ("not installable: litgpt 0.5.13 pins huggingface-hub<1.4 and jsonargparse<=4.41, below this "
              "environment's; `make bench` installs it without dependencies into .venv/peers")


def matmul_peak(dtype: torch.dtype, n: int = 2048, reps: int = 5) -> float:
    """FLOP/s of the fastest of `reps` n x n x n matmuls."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def step_flops(model, tokens: int, seq_len: int) -> float:
    cfg = model.config
    matmul = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    return tokens * (6 * matmul + 12 * cfg.num_hidden_layers * cfg.hidden_size * seq_len)


def litgpt_copy(model, hf):
    """litgpt's GPT of the same shape, loaded with litgpt's own converter from the transformers weights."""
    if PEERS_DIR.is_dir() and str(PEERS_DIR) not in sys.path:
        sys.path.append(str(PEERS_DIR))
    from litgpt.config import Config
    from litgpt.model import GPT
    from litgpt.scripts.convert_hf_checkpoint import copy_weights_hf_llama

    c = model.config
    config = Config(
        n_layer=c.num_hidden_layers, n_embd=c.hidden_size, n_head=c.num_attention_heads,
        n_query_groups=c.num_key_value_heads, head_size=c.head_size, vocab_size=c.vocab_size,
        padded_vocab_size=c.vocab_size, block_size=c.max_position_embeddings, intermediate_size=c.intermediate_size,
        bias=False, norm_class_name="RMSNorm", norm_eps=c.rms_norm_eps, mlp_class_name="LLaMAMLP",
        rotary_percentage=1.0, rope_base=int(c.rope_theta), parallel_residual=False,
    )
    state: dict[str, torch.Tensor] = {}
    copy_weights_hf_llama(config, {}, state, {k: v.detach().clone() for k, v in hf.state_dict().items()})
    gpt = GPT(config)
    gpt.load_state_dict(state)
    return gpt


def contestants(args, precision: str) -> tuple[dict, dict, object]:
    """Step functions of ours and each peer that installs, and why a peer is missing."""
    from astrai_pl.objectives import Pretrain

    model = small_model().train()
    objective = Pretrain(arch=model.config)
    objective.model = model
    hf = hf_copy(model)
    peers = {"transformers LlamaForCausalLM": hf}
    missing = {}
    try:
        peers["litgpt GPT"] = litgpt_copy(model, hf).train()
    except ImportError:
        missing["litgpt GPT"] = LITGPT_WHY
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed")

    def make(module, forward, loss_of=lambda out: out):
        """`forward()` runs under autocast (for us, the whole training_step, as Lightning runs it);
        `loss_of(out)` after it (litgpt computes its loss outside the autocast region)."""
        opt = torch.optim.AdamW(module.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)

        def step():
            with autocast:
                out = forward()
            loss = loss_of(out)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        return step

    fns = {"ours": make(model, lambda: objective.next_token_loss(batch)[0])}
    fns["transformers LlamaForCausalLM"] = make(hf, lambda: hf(input_ids=ids, labels=ids).loss)
    if "litgpt GPT" in peers:
        from litgpt.utils import chunked_cross_entropy

        gpt = peers["litgpt GPT"]
        fns["litgpt GPT"] = make(gpt, lambda: gpt(ids), lambda logits: chunked_cross_entropy(logits[:, :-1], ids[:, 1:]))
    gaps = {"transformers LlamaForCausalLM": max_logit_gap(model, lambda x: hf(input_ids=x).logits, 8192)}
    if "litgpt GPT" in peers:
        gaps["litgpt GPT"] = max_logit_gap(model, peers["litgpt GPT"], 8192)
    with torch.no_grad(), autocast:  # the same loss on both sides, before any step
        loss_gap = abs(objective.next_token_loss(batch)[0].item() - hf(input_ids=ids, labels=ids).loss.item())
    return fns, {"missing": missing, "gaps": gaps, "loss_gap": loss_gap}, model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--reps", type=int, default=11, help="timed steps per contestant, interleaved")
    parser.add_argument("--budget", type=float, default=100, help="seconds per precision after which no new "
                        "round starts (at least 3 rounds)")
    parser.add_argument("--precision", nargs="+", default=["32-true", "bf16-mixed"])
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args()
    setup()
    rows, command = [], command_line()
    tokens = args.batch * args.seq_len
    for precision in args.precision:
        fns, info, model = contestants(args, precision)
        dtype = torch.bfloat16 if precision == "bf16-mixed" else torch.float32
        peak = matmul_peak(dtype)
        results = duels(fns, args.reps, budget_s=args.budget)
        peak = max(peak, matmul_peak(dtype))  # before and after: the less disturbed one
        flops = step_flops(model, tokens, args.seq_len)
        for peer, duel_ in results.items():
            row = row_from(duel_, f"training step, {precision}", peer, 1, "s/step", command, target=1.0)
            row.detail += f"; max logit gap {info['gaps'][peer]:.1e}"
            if peer.startswith("transformers"):
                row.detail += f"; loss gap {info['loss_gap']:.1e}"
            rows.append(row)
        for peer, why in info["missing"].items():
            rows.append(Row(f"training step, {precision}", peer, None, note=why, command=command))
        ours_mfu = flops / next(iter(results.values())).median("ours") / peak
        peer_mfu = ", ".join(f"{p.split()[0]} {flops / d.median('peer') / peak:.1%}" for p, d in results.items())
        rows.append(Row(f"training step MFU, {precision}", f"torch.mm peak {peak / 1e9:.0f} GFLOP/s", None,
                        note=f"ours {ours_mfu:.1%}; {peer_mfu}", command=command,
                        detail=f"{flops / 1e9:.0f} GFLOP per step"))
        print(f"{precision}: batch {args.batch} x {args.seq_len}", flush=True)
        emit(rows[-len(results) - len(info["missing"]) - 1:])
        del fns, model
    save(rows, args.json)


if __name__ == "__main__":
    main()
