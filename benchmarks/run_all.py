"""Every peer benchmark, each in a fresh process, gathered into one table of ratios (`make bench`).

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/run_all.py [--write-docs] [--only step rollout …]

Ratios are peer time / our time on the same work (above 1: we are faster), the median over interleaved
repetitions by the wall clock, with the same ratio by process CPU time in parentheses (see harness.py).
`--write-docs` puts the same table into docs/benchmarks.md, between its two marker lines, so the doc
shows exactly what the run printed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import ROOT, Row, machine  # noqa: E402

BENCHES = {  # name: (script, arguments); in the order they run
    "step": ("bench_step.py", []),
    "posttrain": ("bench_posttrain.py", []),
    "posttrain-more": ("bench_posttrain_more.py", []),
    "posttrain-online": ("bench_posttrain_online.py", []),
    "rollout": ("bench_rollout.py", []),
    "decode": ("bench_decode.py", []),
    "lora": ("bench_lora_sft.py", []),
    "lora-memory": ("bench_lora_memory.py", []),
    "lora-dpo-memory": ("bench_lora_dpo_memory.py", []),
    "eval": ("bench_eval.py", []),
    "rwkv": ("bench_rwkv.py", []),
    "rwkv-decode": ("bench_rwkv_decode.py", []),
    "serve": ("bench_serve.py", ["--repeats", "3", "--budget", "60"]),
    "data": ("bench_data.py", ["--size-gb", "2", "--sft-rows", "0"]),
}
try:  # the GPU training duel joins where a CUDA device is present (its CPU dry run is a test)
    import torch

    if torch.cuda.is_available():
        BENCHES["gpu-train"] = ("gpu_train.py", [])
except ImportError:
    pass
DOC = ROOT / "docs" / "benchmarks.md"
BEGIN, END = "<!-- bench-table:begin -->", "<!-- bench-table:end -->"


def run(name: str) -> tuple[list[Row], float]:
    script, extra = BENCHES[name]
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "rows.json"
        cmd = [sys.executable, str(Path(__file__).parent / script), *extra, "--json", str(out)]
        start = time.perf_counter()
        print(f"== {script}", flush=True)
        done = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "2"})
        seconds = time.perf_counter() - start
        if done.returncode or not out.exists():
            return [Row(name, "-", None, note=f"failed (exit {done.returncode}); run {script} alone")], seconds
        return [Row(**r) for r in json.loads(out.read_text())], seconds


def table(rows: list[Row], date: str, where: str) -> str:
    lines = ["| measure | peer | ratio | command | date | machine |", "|---|---|---|---|---|---|"]
    for r in rows:
        ratio = r.ratio_text if r.target is None or r.ratio is None else f"{r.ratio_text} (target {r.target:g}x)"
        lines.append(f"| {r.measure} | {r.peer} | {ratio} | `{r.command}` | {date} | {where} |")
    return "\n".join(lines)


def details(rows: list[Row]) -> str:
    return "\n".join(f"- {r.measure} vs {r.peer}: {r.detail}" for r in rows if r.detail)


def write_docs(text: str) -> None:
    doc = DOC.read_text()
    if BEGIN not in doc or END not in doc:
        raise SystemExit(f"{DOC} has no {BEGIN} / {END} lines to put the table between")
    head, rest = doc.split(BEGIN, 1)
    DOC.write_text(f"{head}{BEGIN}\n{text}\n{END}{rest.split(END, 1)[1]}")
    print(f"table written to {DOC.relative_to(ROOT)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=list(BENCHES), default=list(BENCHES))
    parser.add_argument("--write-docs", action="store_true", help="also write the table into docs/benchmarks.md")
    args = parser.parse_args()
    start, rows, took = time.perf_counter(), [], {}
    load = os.getloadavg()[0]
    for name in args.only:
        got, took[name] = run(name)
        rows += got
    total = time.perf_counter() - start
    date = datetime.date.today().isoformat()
    load_after = os.getloadavg()[0]
    text = table(rows, date, machine())
    timing = ", ".join(f"{n} {s:.0f} s" for n, s in took.items())
    footer = (f"Wall time {total / 60:.1f} min ({timing}); load average {load:.1f} before, {load_after:.1f} after "
              f"(on {os.cpu_count()} cores).")
    short = [r for r in rows if r.target is not None and r.ratio is not None and r.ratio < r.target]
    print("\n" + text + "\n\n" + details(rows) + "\n\n" + footer)
    if short:
        print("below target: " + "; ".join(f"{r.measure} vs {r.peer} {r.ratio:.2f}x < {r.target:g}x" for r in short))
    if args.write_docs:
        write_docs(text + "\n\nBehind the ratios:\n\n" + details(rows) + "\n\n" + footer)


if __name__ == "__main__":
    main()
