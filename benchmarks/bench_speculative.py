"""N-gram speculative decoding against plain decoding, on the same engine settings, in one process.

Two models of one preset, on three workloads:
- "copies": a model built to copy (`copying_model`: the residual stream keeps the current token, and the
  output projection maps token t to the next token of a fixed random cycle, with attention's small share
  of the residual left to nudge the logits), given prompts that quote a stretch of that cycle and then
  start it again: its greedy continuation repeats the quoted text, as editing or quoting a source does;
- "edited": the copying model on quotes with every third token replaced: the continuation follows the cycle,
  and the two untouched tokens it ends with are always followed by a replaced one in the quote, so drafts are
  proposed at most steps and every one is rejected, the case where speculation costs most;
- "rejected": the quoting prompts given to the preset with random weights, which does not follow them: after the
  first step its own output has nothing to look up;
- "free": random weights on random prompts: nothing to look up, so drafts are rare.
Rounds alternate plain and speculative engines (ABBA); reported per workload: tokens/s of each, the median
per-round ratio speculative / plain (above 1: speculation is faster), the draft acceptance rate, and whether
the two produced the same tokens (greedy: they must). "drafted" is draft tokens verified per generated token.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_speculative.py [--preset small] [--batch 1] [--k 4]
    .venv/bin/python benchmarks/bench_speculative.py --dry-run     # tiny sizes, one round: the test's run
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import setup  # noqa: E402

from astrai_pl.inference import Engine, SamplingParams, SpeculativeConfig  # noqa: E402
from astrai_pl.model import ModelConfig, Transformer  # noqa: E402


def random_model(config: ModelConfig, seed: int = 0) -> Transformer:
    """Random weights wide enough that greedy decoding neither repeats one token nor ignores its context."""
    torch.manual_seed(seed)
    model = Transformer(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 2:
                param.normal_(0.0, {"embed_tokens.weight": 1.0, "lm_head.weight": 0.1}.get(name, 0.2))
    return model


def copying_model(config: ModelConfig, seed: int = 0, follow: float = 4.0, mix: float = 0.1) -> tuple[Transformer, list[int]]:
    """A model whose greedy output follows a fixed cycle over the vocabulary (token t → cycle successor), and
    that cycle. Every layer's output projections are scaled to `mix` / sqrt(fan-in) so the residual stream stays
    near the current token's embedding (attention and MLP only nudge it); the output projection's row for t's
    successor is `follow` × t's embedding direction."""
    model = random_model(config, seed)
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(config.vocab_size - 8, generator=g) + 8  # ids below 8: special tokens, left out
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 2 and "embed" not in name and "lm_head" not in name:
                param.normal_(0.0, 1.0 / param.shape[1] ** 0.5)
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    param.mul_(mix * 8)
        embed = model.embed_tokens.weight
        unit = embed / embed.norm(dim=-1, keepdim=True)
        head = model.lm_head.weight
        head.mul_(0.5)
        head[order.roll(-1)] += follow * unit[order]
    return model, order.tolist()


def workloads(cycle: list[int], vocab: int, n: int, quote: int, seed: int = 0) -> dict[str, list[list[int]]]:
    """"copies": a quoted stretch of the cycle, then its first tokens again; "edited": the same with every third
    quoted token replaced by a random one (every draft looked up in it starts with a replaced token); "free":
    random prompts."""
    g = torch.Generator().manual_seed(seed)
    copies, edited, free = [], [], []
    for _ in range(n):
        start = int(torch.randint(0, len(cycle) - quote, (1,), generator=g))
        stretch = cycle[start : start + quote]
        copies.append(stretch + stretch[:3])
        noise = torch.randint(8, vocab, (quote,), generator=g).tolist()
        changed = [noise[i] if i % 3 == 2 else t for i, t in enumerate(stretch)]
        edited.append(changed + stretch[:2])
        free.append(torch.randint(8, vocab, (quote + 3,), generator=g).tolist())
    return {"copies": copies, "edited": edited, "free": free}


def timed(engine: Engine, prompts, params) -> tuple[float, list[list[int]], int]:
    start = time.perf_counter()
    out = engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    ids = [c.token_ids for c in out]
    return seconds, ids, sum(len(t) for t in ids)


def measure(model, prompts, params, spec: SpeculativeConfig, rounds: int) -> dict:
    plain, fast = Engine(model, page_size=16), Engine(model, page_size=16, speculative=spec)
    for engine in (plain, fast):
        engine.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm-up
    times = {False: [], True: []}
    tokens: dict[bool, list] = {}
    count = 0
    for r in range(rounds):
        for speculative in ((False, True) if r % 2 == 0 else (True, False)):
            seconds, ids, count = timed(fast if speculative else plain, prompts, params)
            times[speculative].append(seconds)
            tokens[speculative] = ids
    stats = fast.stats
    drafted, accepted = stats.draft_tokens, stats.accepted_draft_tokens
    return dict(
        plain=count / statistics.median(times[False]), spec=count / statistics.median(times[True]),
        ratio=statistics.median(p / s for p, s in zip(times[False], times[True])),
        acceptance=accepted / drafted if drafted else 0.0, same=tokens[False] == tokens[True],
        drafted=drafted / (rounds * count),  # draft tokens per generated token
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--lookup-max", type=int, default=4)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quote", type=int, default=96, help="tokens quoted by each copying prompt")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--dry-run", action="store_true", help="debug preset, one short round")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.preset, args.batch, args.quote, args.max_tokens, args.rounds = "debug", 2, 24, 12, 1
    setup(args.threads)
    config = ModelConfig.from_name(args.preset)
    spec = SpeculativeConfig(num_speculative_tokens=args.k, prompt_lookup_max=args.lookup_max)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    copier, cycle = copying_model(config)
    prompts = workloads(cycle, config.vocab_size, args.batch, args.quote)
    print(f"preset={args.preset} batch={args.batch} k={args.k} lookup_max={args.lookup_max} "
          f"max_tokens={args.max_tokens} rounds={args.rounds} threads={torch.get_num_threads()}")
    print(f"{'workload':<9} {'plain tok/s':>12} {'spec tok/s':>11} {'spec/plain':>10} {'drafted':>8} {'accepted':>9} same")
    plain_model = random_model(config)
    for name, model, workload in (("copies", copier, "copies"), ("edited", copier, "edited"),
                                  ("rejected", plain_model, "copies"), ("free", plain_model, "free")):
        row = measure(model, prompts[workload], params, spec, args.rounds)
        print(f"{name:<9} {row['plain']:>12.1f} {row['spec']:>11.1f} {row['ratio']:>10.2f} "
              f"{row['drafted']:>8.2f} {row['acceptance']:>9.0%} {row['same']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
