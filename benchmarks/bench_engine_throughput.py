"""Engine throughput on CPU: tokens/s of our Engine alone on three workloads at two model shapes.

    ragged   16 prompts of 16…200 tokens, 64 new tokens each, greedy, end-of-sequence ignored
    shared   16 requests sharing a 512-token prefix, distinct 16-token tails, 64 new tokens each
    stream   one prompt of 32 tokens, 256 new tokens

Shapes (random weights, float32): `small` (hidden 512, 8 layers, 8/2 heads, vocab 8192) and
`SmolLM2-135M` (hidden 576, 30 layers, 9/3 heads, vocab 49152, tied embeddings). Tokens/s counts new
tokens only, over the whole `generate` call (prefill included); the radix cache is emptied before each
run, so every run computes its prompts (the shared workload computes its prefix once per run). Each
workload is warmed up once, then run `--repeats` times; the median is reported. The prompts are
`workload_prompts(name, vocab)`, so a peer (benchmarks/bench_serve.py) can run the very same ids.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_engine_throughput.py [--shapes small] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import make_prompts, shared_prefix_prompts  # noqa: E402
from harness import setup  # noqa: E402

from astrai_pl.inference import Engine, SamplingParams  # noqa: E402
from astrai_pl.model import ModelConfig, Transformer  # noqa: E402

SHAPES = ("small", "SmolLM2-135M")
NEW_TOKENS = {"ragged": 64, "shared": 64, "stream": 256}


def workload_prompts(name: str, vocab: int) -> list[list[int]]:
    """The prompts of workload `name` (ids in [3, vocab)): the same for every contestant."""
    if name == "ragged":
        return make_prompts(16, 16, 200, vocab, seed=0)
    if name == "shared":
        return shared_prefix_prompts(vocab, requests=16, prefix=512, suffix=16)
    if name == "stream":
        return make_prompts(1, 32, 32, vocab, seed=3)
    raise ValueError(f"workload {name!r}: use one of {', '.join(NEW_TOKENS)}")


def model_of(shape: str, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(ModelConfig.from_name(shape)).eval()


def run(engine: Engine, prompts: list[list[int]], new_tokens: int) -> tuple[float, float, list[list[int]]]:
    """Wall and process CPU seconds of one `generate` of every prompt, and the generated ids."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    engine.reset_prefix_cache()
    start, cpu = time.perf_counter(), time.process_time()
    outs = engine.generate(prompts, params)
    return time.perf_counter() - start, time.process_time() - cpu, [o.token_ids for o in outs]


def measure(shape: str, workloads: list[str], repeats: int) -> list[dict]:
    model = model_of(shape)
    engine = Engine(model, page_size=16)
    rows = []
    for name in workloads:
        prompts, new = workload_prompts(name, model.config.vocab_size), NEW_TOKENS[name]
        run(engine, prompts, new)  # warm-up: weight copies, mirror buffers, allocator
        runs = [run(engine, prompts, new) for _ in range(repeats)]
        times, cpu = [r[0] for r in runs], [r[1] for r in runs]
        tokens = len(prompts) * new
        rate = tokens / statistics.median(times)
        rows.append(dict(shape=shape, workload=name, tokens=tokens, tokens_per_s=round(rate, 1),
                         seconds=[round(t, 3) for t in times], cpu_seconds=[round(t, 3) for t in cpu],
                         outputs=hash(str(runs[-1][2]))))
        print(f"  {shape:13s} {name:7s} {rate:8.1f} tok/s  (median of {repeats}: "
              f"{', '.join(f'{t:.2f}' for t in times)} s wall, {', '.join(f'{t:.2f}' for t in cpu)} s CPU)",
              flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=SHAPES)
    parser.add_argument("--workloads", nargs="+", default=list(NEW_TOKENS), choices=list(NEW_TOKENS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args()
    setup(args.threads)
    print(f"engine throughput, float32, {torch.get_num_threads()} threads, greedy, ignore_eos")
    rows = [row for shape in args.shapes for row in measure(shape, args.workloads, args.repeats)]
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
