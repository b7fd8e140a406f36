"""Data preparation: a corpus bigger than memory streamed next to the map-style path, and SFT rows.

Streaming (the default section): a generated JSONL corpus (2 GB by default) is read, tokenized and cut
into windows by `PretrainData(streaming=True)` from start to end of the file, with its throughput
(tokens/s tokenized and packed) and peak resident set; next to it the map-style path (`Dataset.map`,
cached windows, one epoch of the resumable loader) on a corpus that fits (`--map-mb`), whose memory grows
with the corpus. Each path runs in a fresh process, so each peak RSS is its own; the corpora live in a
temporary folder (`--dir`, default the system's) and are deleted afterwards. The load average of the
machine is printed before and after, since the cores may be shared.

SFT rows (`--sft-rows N`, 0 = skip): synthetic SFT rows generated, rendered through the chat template,
encoded and masked with `Dataset.map`, first into an empty cache and then from it, then packed; the peer
is `encode_row` in a plain loop.

    taskset -c 0,1 .venv/bin/python benchmarks/bench_data.py [--size-gb 2] [--map-mb 64] [--sft-rows 20000]

A benchmark, not a test: the full 2 GB is about 2.1 billion byte tokens, an hour at 650k tokens/s on
two cores with little else running, hours on cores shared with other work.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Row, command_line, emit, save, setup  # noqa: E402

WORDS = ("the of and to in is that for it as with was on by at from this which or an be are not "
         "function value list string error module class object return file number type data").split()


# --- the streamed corpus -----------------------------------------------------------------------------


def write_corpus(path: Path, size_bytes: int) -> int:
    """JSONL documents of 20-400 words until the file holds `size_bytes`; returns the documents written."""
    rng = random.Random(0)
    pool = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 400))) for _ in range(2000)]
    written = docs = 0
    with open(path, "w") as handle:
        while written < size_bytes:
            lines = "".join(json.dumps({"text": f"{docs + i}: {pool[(docs + i) * 7919 % len(pool)]}"}) + "\n"
                            for i in range(1000))
            handle.write(lines)
            written, docs = written + len(lines), docs + 1000
    return docs


def rss_mb() -> float:
    """The resident set now (MiB)."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * resource.getpagesize() / 2**20


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def load_average() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def consume_streaming(path: str, seq_len: int, batch_size: int, cache: str, limit_gb: float | None) -> dict:
    """One whole pass over the file through the streaming loader: tokens, seconds, RSS along the way."""
    from astrai_pl.data import PretrainData

    data = PretrainData(path=path, streaming=True, seq_len=seq_len, batch_size=batch_size, val_rows=16,
                        cache_dir=cache)
    data.setup("fit")
    loader = data.train_dataloader()
    start_rss, samples, batches = rss_mb(), [], 0
    limit = float("inf") if limit_gb is None else limit_gb * 2**30  # byte-level: a token a byte, about
    start = time.perf_counter()
    for batches, _ in enumerate(loader, start=1):
        if batches % 2000 == 0:
            samples.append(round(rss_mb()))
            print(f"{batches} batches, {time.perf_counter() - start:.0f} s, RSS {samples[-1]} MiB, load "
                  f"{load_average()}", file=sys.stderr, flush=True)
        if loader.position["sources"][0]["pass"] > 0 or batches * batch_size * seq_len >= limit:
            break  # the whole file was read once (the next pass began), or the --consume-gb limit
    seconds = time.perf_counter() - start
    return {"tokens": batches * batch_size * seq_len, "seconds": seconds, "start_rss_mb": start_rss,
            "rss_samples_mb": samples, "peak_rss_mb": peak_mb()}


def consume_map(path: str, seq_len: int, batch_size: int, cache: str) -> dict:
    """The map-style path: tokenize into the cache, then one epoch of the resumable loader."""
    from astrai_pl.data import PretrainData

    start = time.perf_counter()
    data = PretrainData(path=path, seq_len=seq_len, batch_size=batch_size, val_fraction=0.01, cache_dir=cache)
    data.setup("fit")
    batches = sum(1 for _ in data.train_dataloader())
    seconds = time.perf_counter() - start
    return {"tokens": batches * batch_size * seq_len, "seconds": seconds, "peak_rss_mb": peak_mb()}


def child(args: argparse.Namespace) -> None:
    setup()
    if args.mode == "streaming":
        result = consume_streaming(args.file, args.seq_len, args.batch_size, args.cache, args.consume_gb)
    else:
        result = consume_map(args.file, args.seq_len, args.batch_size, args.cache)
    print(json.dumps(result))


def run_child(mode: str, file: Path, args: argparse.Namespace, cache: Path) -> dict:
    cmd = [sys.executable, __file__, "--mode", mode, "--file", str(file), "--cache", str(cache),
           "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size)]
    if args.consume_gb is not None:
        cmd += ["--consume-gb", str(args.consume_gb)]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=False)  # progress on stderr
    if done.returncode:
        raise SystemExit(f"{mode} run failed (exit {done.returncode})")
    return json.loads(done.stdout.strip().splitlines()[-1])


def streaming_rows(args: argparse.Namespace) -> list[Row]:
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        big, small = Path(folder) / "big.jsonl", Path(folder) / "small.jsonl"
        docs = write_corpus(big, int(args.size_gb * 2**30))
        write_corpus(small, int(args.map_mb * 2**20))
        print(f"corpora written: {big.stat().st_size / 2**30:.2f} GiB ({docs} documents), "
              f"{small.stat().st_size / 2**20:.0f} MiB; load average {load_average()}", flush=True)
        ours = run_child("streaming", big, args, Path(folder) / "cache")
        between = load_average()
        peer = run_child("map", small, args, Path(folder) / "cache")
    load = f"load average {between} after streaming, {load_average()} at the end"
    ours_rate, peer_rate = ours["tokens"] / ours["seconds"], peer["tokens"] / peer["seconds"]
    print(f"streaming {args.size_gb:g} GB file: {ours['tokens']:,} tokens in {ours['seconds']:.0f} s = "
          f"{ours_rate:,.0f} tokens/s tokenized and packed; RSS {ours['start_rss_mb']:.0f} MiB at the start, "
          f"every 2000 batches {ours['rss_samples_mb']} MiB, peak {ours['peak_rss_mb']:.0f} MiB")
    print(f"map-style {args.map_mb:g} MB: {peer['tokens']:,} tokens in {peer['seconds']:.0f} s = "
          f"{peer_rate:,.0f} tokens/s (tokenize + cache + one epoch); peak {peer['peak_rss_mb']:.0f} MiB; {load}")
    return [Row(f"streaming data, {args.size_gb:g} GB jsonl", f"map-style PretrainData, {args.map_mb:g} MB",
                ours_rate / peer_rate,
                detail=f"streaming {ours['tokens']:,} tokens at {ours_rate:,.0f} tokens/s, peak RSS "
                       f"{ours['peak_rss_mb']:.0f} MiB; map-style {peer_rate:,.0f} tokens/s, peak RSS "
                       f"{peer['peak_rss_mb']:.0f} MiB; {load}",
                command=command_line())]


# --- SFT rows ------------------------------------------------------------------------------------------


def prepare_sft(rows: int, cache_dir: str, num_proc: int | None) -> tuple[float, object]:
    from astrai_pl.data.preprocess import preset_sections
    from astrai_pl.data.synthetic import synthetic_dataset
    from astrai_pl.data.tokenized import tokenize_dataset
    from astrai_pl.tokenizer import Tokenizer

    start = time.perf_counter()
    raw = synthetic_dataset("sft", rows, cache_dir=cache_dir)
    encoded = tokenize_dataset(raw, preset_sections("messages"), Tokenizer.byte_level(), num_proc=num_proc)
    return time.perf_counter() - start, encoded


def sft_rows(args: argparse.Namespace) -> None:
    from astrai_pl.data.formats import encode_row
    from astrai_pl.data.packing import pack_rows
    from astrai_pl.data.preprocess import preset_sections
    from astrai_pl.data.synthetic import generate_rows
    from astrai_pl.tokenizer import Tokenizer

    with tempfile.TemporaryDirectory(dir=args.dir) as scratch:
        first, encoded = prepare_sft(args.sft_rows, scratch, args.num_proc)
        cached, again = prepare_sft(args.sft_rows, scratch, args.num_proc)
        assert again["input_ids"][:5] == encoded["input_ids"][:5]
        start = time.perf_counter()
        _, stats = pack_rows(encoded, args.max_seq_len, "bfd")
        packing = time.perf_counter() - start
        tokens = sum(len(ids) for ids in encoded["input_ids"])
    tokenizer, sections = Tokenizer.byte_level(), preset_sections("messages")
    start = time.perf_counter()
    for row in generate_rows("sft", args.sft_rows):
        encode_row(row, sections, tokenizer)
    loop = time.perf_counter() - start
    print(f"{args.sft_rows} synthetic SFT rows, {tokens} tokens, num_proc={args.num_proc}")
    print(f"  first call (generate + template + encode + mask): {first:6.2f} s")
    print(f"  second call, from cache:                           {cached:6.2f} s")
    print(f"  peer, encode_row in a plain loop (no cache):       {loop:6.2f} s  "
          f"(first time / peer = {first / loop:.2f}, cached / peer = {cached / loop:.3f})")
    print(f"  bfd packing plan to {args.max_seq_len} tokens: {packing:6.2f} s  ({stats.describe()})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=2.0, help="size of the streamed corpus (0: skip)")
    parser.add_argument("--consume-gb", type=float, default=None,
                        help="stop the streamed pass after this much of the file's text (default: all of it)")
    parser.add_argument("--map-mb", type=float, default=64.0, help="size of the map-style corpus")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--sft-rows", type=int, default=20_000, help="synthetic SFT rows prepared (0: skip)")
    parser.add_argument("--num-proc", type=int, default=None, help="SFT rows: processes of Dataset.map")
    parser.add_argument("--max-seq-len", type=int, default=512, help="SFT rows: packing length")
    parser.add_argument("--dir", default=None, help="where the corpora are written (default: the temp folder)")
    parser.add_argument("--json", default=None, help="also write the rows here")
    parser.add_argument("--mode", choices=("streaming", "map"), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--file", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--cache", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode:
        return child(args)
    setup()
    if args.sft_rows:
        sft_rows(args)
    rows = streaming_rows(args) if args.size_gb else []
    emit(rows)
    save(rows, args.json)


if __name__ == "__main__":
    main()
