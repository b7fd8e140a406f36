"""Decode throughput: our Engine against `transformers`' generate on the same weights, on CPU.

A ~30M-parameter Llama shape (the `small` preset: hidden 512, 8 layers, 8 query / 2 key-value heads,
vocab 8192), float32, 2 threads. 16 prompts of 16…200 tokens, 64 new tokens each, greedy, end-of-sequence
ignored. The engine takes all 16 at once (continuous batching, paged KV cache); transformers runs
padded batches of 8 with left padding. Both are warmed up on a short job, then run alternately
`--repeats` times; the ratio is the median of the per-run ratios (harness.py).

The shared-prefix workload: 16 requests that share a 512-token prefix (a long system prompt) and differ
in their last 16 tokens, 16 new tokens each. The engine computes the prefix once (radix cache);
transformers runs padded batches of 8. Also counts the engine's prefill tokens with the radix cache off
and on.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_decode.py
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Row, command_line, duel, emit, hf_copy, row_from, save, setup, small_model  # noqa: E402

from astrai_pl.inference import Engine, SamplingParams  # noqa: E402


def make_prompts(count: int, shortest: int, longest: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.linspace(shortest, longest, count).round().int().tolist()
    order = torch.randperm(count, generator=g).tolist()  # mixed lengths in each padded batch
    return [torch.randint(3, vocab, (lengths[i],), generator=g).tolist() for i in order]


def run_engine(engine: Engine, prompts, new_tokens: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    engine.reset_prefix_cache()  # every run computes every prompt (the weights, and their copies, stay)
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    return time.perf_counter() - start, [o.token_ids for o in outs]


@torch.inference_mode()
def run_transformers(hf, prompts, new_tokens: int, batch: int) -> tuple[float, list[list[int]]]:
    def generate(group: list[list[int]], steps: int) -> list[list[int]]:
        width = max(len(p) for p in group)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in group])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
        out = hf.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=steps,
            do_sample=False,
            pad_token_id=0,
        )
        return out[:, width:].tolist()

    start = time.perf_counter()
    outs = [
        row for i in range(0, len(prompts), batch) for row in generate(prompts[i : i + batch], new_tokens)
    ]
    return time.perf_counter() - start, outs


def shared_prefix_prompts(vocab: int, requests: int, prefix: int, suffix: int) -> list[list[int]]:
    system = make_prompts(1, prefix, prefix, vocab, seed=1)[0]
    return [system + q for q in make_prompts(requests, suffix, suffix, vocab, seed=2)]


def shared_prefix_prefill(model, prompts) -> dict[bool, int]:
    counts = {}
    for prefix_cache in (False, True):
        engine = Engine(model, page_size=16, prefix_cache=prefix_cache)
        engine.generate(prompts, SamplingParams(max_tokens=1, temperature=0))
        counts[prefix_cache] = engine.stats.prefill_tokens
    return counts


def compare(engine, hf, prompts, new_tokens: int, hf_batch: int, repeats: int, budget_s: float):
    """Interleaved runs of both; the duel, and how many prompts got identical greedy outputs."""
    outs = {}

    def ours():
        outs["ours"] = run_engine(engine, prompts, new_tokens)[1]

    def theirs():
        outs["peer"] = run_transformers(hf, prompts, new_tokens, hf_batch)[1]

    run_engine(engine, prompts[:2], 4)  # warm-up, both sides, on a short job
    run_transformers(hf, prompts[:2], 4, hf_batch)
    result = duel(ours, theirs, repeats, warmup=0, budget_s=budget_s)
    return result, sum(a == b for a, b in zip(outs["ours"], outs["peer"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--hf-batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=9, help="alternate runs of each; the median ratio counts")
    parser.add_argument("--budget", type=float, default=90, help="seconds per workload after which no new "
                        "round starts (at least 3 rounds)")
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args()
    setup(args.threads)
    model = small_model().eval()
    hf = hf_copy(model)
    command = command_line()
    prompts = make_prompts(args.prompts, 16, 200, model.config.vocab_size, seed=0)
    total = args.prompts * args.new_tokens
    print(
        f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, float32, "
        f"{torch.get_num_threads()} threads; {args.prompts} prompts of 16-200 tokens, {args.new_tokens} new each"
    )
    engine = Engine(model, page_size=16)
    result, same = compare(engine, hf, prompts, args.new_tokens, args.hf_batch, args.repeats, args.budget)
    rows = [row_from(result, f"decode, {args.prompts} prompts x {args.new_tokens} tokens, greedy",
                     f"transformers generate (batches of {args.hf_batch})", total, "tokens/s", command, 1.5)]
    rows[-1].detail += f"; greedy outputs identical for {same}/{len(prompts)}"
    emit(rows[-1:])

    shared = shared_prefix_prompts(model.config.vocab_size, requests=16, prefix=512, suffix=16)
    result, same = compare(engine, hf, shared, 16, args.hf_batch, args.repeats, args.budget / 2)
    rows.append(row_from(result, "shared prefix, 16 x (512 shared + 16) tokens, 16 new",
                         f"transformers generate (batches of {args.hf_batch})", 16 * 16, "tokens/s", command))
    counts = shared_prefix_prefill(model, shared)
    rows[-1].detail += (f"; prefill tokens {counts[False]} without the radix cache, {counts[True]} with it; "
                        f"greedy outputs identical for {same}/{len(shared)}")
    rows.append(Row("shared prefix: prefill tokens computed", "engine without the radix cache",
                    counts[False] / counts[True], None, f"{counts[False]} vs {counts[True]} tokens", command))
    emit(rows[-2:])
    save(rows, args.json)


if __name__ == "__main__":
    main()
