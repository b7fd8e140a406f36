"""Decode throughput: our Engine against `transformers`' generate on the same weights, on CPU.

A ~30M-parameter Llama shape (the `small` preset: hidden 512, 8 layers, 8 query / 2 key-value heads,
vocab 8192), float32, 2 threads. 16 prompts of 16…200 tokens, 64 new tokens each, greedy, end-of-sequence
ignored. The engine takes all 16 at once (continuous batching, paged KV cache); transformers runs
padded batches of 8 with left padding. Both are warmed up, then run alternately `--repeats` times; the
best run of each counts. Also counts prefill tokens of a shared-prefix workload with the radix cache off
and on.

    taskset -c 0,1 .venv/bin/python benchmarks/bench_decode.py
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time

import torch

from astrai_pl.inference import Engine, SamplingParams
from astrai_pl.model import ModelConfig, Transformer


def make_prompts(count: int, shortest: int, longest: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.linspace(shortest, longest, count).round().int().tolist()
    order = torch.randperm(count, generator=g).tolist()  # mixed lengths in each padded batch
    return [torch.randint(3, vocab, (lengths[i],), generator=g).tolist() for i in order]


def run_engine(engine: Engine, prompts, new_tokens: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    engine.reset_prefix_cache()  # every run computes every prompt
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


def shared_prefix_prefill(model, requests: int, prefix: int, suffix: int) -> dict[bool, int]:
    system = make_prompts(1, prefix, prefix, model.config.vocab_size, seed=1)[0]
    prompts = [system + q for q in make_prompts(requests, suffix, suffix, model.config.vocab_size, seed=2)]
    counts = {}
    for prefix_cache in (False, True):
        engine = Engine(model, page_size=16, prefix_cache=prefix_cache)
        engine.generate(prompts, SamplingParams(max_tokens=1, temperature=0))
        counts[prefix_cache] = engine.stats.prefill_tokens
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--hf-batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="alternate runs of each; the best counts")
    args = parser.parse_args()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    from transformers import AutoModelForCausalLM

    model = Transformer(ModelConfig.from_name("small")).eval()
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    prompts = make_prompts(args.prompts, 16, 200, model.config.vocab_size, seed=0)
    total = args.prompts * args.new_tokens
    print(
        f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, float32, "
        f"{torch.get_num_threads()} threads; {args.prompts} prompts of 16-200 tokens, {args.new_tokens} new each"
    )

    engine = Engine(model, page_size=16)
    engine.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0))  # warm-up, both sides
    run_transformers(hf, prompts[:2], 4, args.hf_batch)
    ours_runs, theirs_runs = [], []
    for _ in range(args.repeats):  # alternated, so a burst of load elsewhere hits both
        ours_s, ours = run_engine(engine, prompts, args.new_tokens)
        theirs_s, theirs = run_transformers(hf, prompts, args.new_tokens, args.hf_batch)
        ours_runs.append(ours_s)
        theirs_runs.append(theirs_s)
    ours_s, theirs_s = min(ours_runs), min(theirs_runs)
    same = sum(a == b for a, b in zip(ours, theirs))
    runs = f"best of {args.repeats}"
    print(
        f"engine        {total / ours_s:8.1f} tokens/s  ({ours_s:.2f} s {runs}, all prompts continuously batched)"
    )
    print(
        f"transformers  {total / theirs_s:8.1f} tokens/s  ({theirs_s:.2f} s {runs}, padded batches of {args.hf_batch})"
    )
    print(
        f"ratio         {theirs_s / ours_s:8.2f}x  (greedy outputs identical for {same}/{len(prompts)} prompts)"
    )

    counts = shared_prefix_prefill(model, requests=16, prefix=512, suffix=16)
    print(
        f"shared prefix (16 requests, 512-token prefix + 16): prefill tokens {counts[False]} without the "
        f"radix cache, {counts[True]} with it ({counts[False] / counts[True]:.1f}x fewer)"
    )


if __name__ == "__main__":
    main()
