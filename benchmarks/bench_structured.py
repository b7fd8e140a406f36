"""The cost of structured outputs: decoding under a JSON schema against plain decoding, same engine, same batch.

A random-weight `tiny` model (4 layers, width 192) with a byte-level BPE tokenizer of 8,192 ids trained here on
generated text (the mask costs in proportion to the vocabulary, so the byte tokenizer's 320 ids would flatter
it), float32 on 2 threads. 32 prompts decode 64 tokens each:

1. engine: `Engine.generate` of the batch with no constraint (end of sequence ignored) against the same batch
   under a JSON schema (an array of at least 64 short strings, so no row ends before 64 tokens). Ratio: masked
   time over plain time (the harness's peer / ours, with the plain run as "ours"), interleaved repetitions (ABBA).
2. sampler: one batched `sample` call on (32, V) logits with each row's grammar mask against the same call
   without (the masked step in isolation: the bitmask fill of 32 matchers, the unpack and the masked fill).

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_structured.py          # --dry-run: seconds, tiny shapes
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import command_line, duel, emit, row_from, save, setup  # noqa: E402

from astrai_pl.inference import Engine, SamplingParams, StructuredOutput  # noqa: E402
from astrai_pl.inference.constraints import row_constraint  # noqa: E402
from astrai_pl.inference.sampling import sample  # noqa: E402
from astrai_pl.model import ModelConfig, Transformer  # noqa: E402
from astrai_pl.tokenizer import Tokenizer, train_bpe  # noqa: E402

SCHEMA = {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 64}


def bpe_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE of `vocab_size` ids trained on generated words and JSON-like text."""
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(6000)]
    lines = [" ".join(rng.choices(words, k=12)) + ' ["' + '", "'.join(rng.choices(words, k=4)) + '"]'
             for _ in range(20000)]
    return train_bpe(lines, vocab_size)


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--reps", type=int, default=6)
    p.add_argument("--dry-run", action="store_true", help="byte tokenizer, debug model, 2 repetitions")
    p.add_argument("--json", help="write the rows here (for run_all.py)")
    return p.parse_args()


def main() -> None:
    args = parse()
    setup()
    if args.dry_run:
        args.batch, args.new_tokens, args.reps = 4, 8, 2
        tokenizer, preset, vocab = Tokenizer.byte_level(), "debug", 320
    else:
        tokenizer, preset, vocab = bpe_tokenizer(args.vocab), "tiny", args.vocab
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_name(preset, vocab_size=vocab)).eval()
    engine = Engine(model, tokenizer, max_total_tokens=args.batch * (args.new_tokens + 64) * 2)
    prompts = [f"item {i}: list the names" for i in range(args.batch)]
    plain = [SamplingParams(max_tokens=args.new_tokens, seed=i, ignore_eos=True) for i in range(args.batch)]
    schema = StructuredOutput(json=SCHEMA)
    masked = [SamplingParams(max_tokens=args.new_tokens, seed=i, structured=schema) for i in range(args.batch)]

    def run(params):
        outs = engine.generate(prompts, params)
        assert all(len(o.token_ids) == args.new_tokens for o in outs), "a row ended early: the timing would lie"

    work = args.batch * args.new_tokens
    rows = [row_from(duel(lambda: run(plain), lambda: run(masked), args.reps), f"decode {args.batch} x "
                     f"{args.new_tokens} tokens, V={vocab}: JSON-schema time / plain time", "plain engine",
                     work, "tokens/s", command_line())]
    rows.append(sampler_row(args, tokenizer, vocab, engine.eos_token_ids))
    emit(rows)
    for r in rows:
        print(f"masked / plain time: {r.ratio:.3f}x (CPU time {r.cpu_ratio:.3f}x): {r.measure}")
    save(rows, args.json)


def sampler_row(args, tokenizer, vocab: int, end_ids):
    """One batched `sample` call with and without the rows' grammar masks, on the same logits."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(args.batch, vocab, generator=gen)
    params = SamplingParams(max_tokens=args.new_tokens, structured=StructuredOutput(json=SCHEMA))
    rows = [row_constraint(params, tokenizer, vocab, list(end_ids)) for _ in range(args.batch)]
    context = tokenizer.encode('["ab", "cd", "e')  # mid-string: the widest mask
    contexts, outputs, seeds = [list(context)] * args.batch, [len(context)] * args.batch, list(range(args.batch))
    plain = [SamplingParams(max_tokens=args.new_tokens)] * args.batch

    def call(constraints):
        for _ in range(20):
            sample(logits, plain, contexts, outputs, seeds, constraints)

    d = duel(lambda: call(None), lambda: call(rows), max(args.reps, 5))
    return row_from(d, f"one sample() call, {args.batch} rows, V={vocab}: masked time / plain time", "plain sample",
                    20, "calls/s", command_line())


if __name__ == "__main__":
    main()
