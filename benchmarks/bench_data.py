"""Preparing synthetic SFT rows: generate, render through the chat template, encode and mask with
`Dataset.map` (batched), first into an empty cache and then again from the cache; plus packing.

The peer is the same encoding done row by row with `encode_row` in a plain loop.

    taskset -c 0,1 .venv/bin/python benchmarks/bench_data.py --rows 20000
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time

import datasets

from astrai_pl.data.formats import encode_row
from astrai_pl.data.packing import pack_rows
from astrai_pl.data.preprocess import preset_sections
from astrai_pl.data.synthetic import generate_rows, synthetic_dataset
from astrai_pl.data.tokenized import tokenize_dataset
from astrai_pl.tokenizer import Tokenizer


def prepare(rows: int, cache_dir: str, num_proc: int | None) -> tuple[float, object]:
    start = time.perf_counter()
    raw = synthetic_dataset("sft", rows, cache_dir=cache_dir)
    encoded = tokenize_dataset(raw, preset_sections("messages"), Tokenizer.byte_level(), num_proc=num_proc)
    return time.perf_counter() - start, encoded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--num-proc", type=int, default=None)
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument(
        "--cache-dir",
        default=None,
        help="keep the cache here (a second invocation then reads it); default: a fresh temp dir",
    )
    args = parser.parse_args()
    datasets.disable_progress_bars()
    logging.getLogger("datasets").setLevel(logging.ERROR)

    with tempfile.TemporaryDirectory() as scratch:
        cache_dir = args.cache_dir or scratch
        first, encoded = prepare(args.rows, cache_dir, args.num_proc)
        cached, again = prepare(args.rows, cache_dir, args.num_proc)
        assert again["input_ids"][:5] == encoded["input_ids"][:5]
        start = time.perf_counter()
        packed, stats = pack_rows(encoded, args.max_seq_len, "bfd")
        packing = time.perf_counter() - start

    tokenizer, sections = Tokenizer.byte_level(), preset_sections("messages")
    start = time.perf_counter()
    for row in generate_rows("sft", args.rows):
        encode_row(row, sections, tokenizer)
    loop = time.perf_counter() - start

    tokens = sum(len(ids) for ids in encoded["input_ids"])
    print(f"{args.rows} synthetic SFT rows, {tokens} tokens, num_proc={args.num_proc}")
    print(f"  first call (generate + template + encode + mask): {first:6.2f} s  (budget 10 s)")
    print(f"  second call, from cache:                           {cached:6.2f} s  (budget 1 s)")
    print(
        f"  peer, encode_row in a plain loop (no cache):       {loop:6.2f} s  "
        f"(first time / peer = {first / loop:.2f}, cached / peer = {cached / loop:.3f})"
    )
    print(
        f"  bfd packing plan to {args.max_seq_len} tokens:                  {packing:6.2f} s  ({stats.describe()})"
    )


if __name__ == "__main__":
    main()
