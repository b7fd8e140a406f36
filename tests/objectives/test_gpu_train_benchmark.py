"""benchmarks/gpu_train.py's dry run: every run of the GPU training benchmark goes through its code on CPU, on a
tiny shape, and reports a step time or the reason it did not run."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MEASURED = ["hf-eager", "hf-compiled", "ours-plain", "ours-plain-liger", "ours-fit", "ours-fit-compile",
            "packed-sdpa", "packed-flex", "packed-varlen", "qlora"]


def test_dry_run_takes_every_path(tmp_path):
    out, rows_out = tmp_path / "results.json", tmp_path / "rows.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "benchmarks/gpu_train.py", "--dry-run", "--results", str(out),
                           "--json", str(rows_out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {r["run"]: r for r in json.loads(out.read_text())}
    assert list(rows) == MEASURED[:-1] + ["fp8-tensorwise", "fp8-rowwise", "qlora", "fsdp2"]
    for name in MEASURED:
        assert rows[name]["seconds"] > 0 and rows[name]["tokens_per_s"] > 0, rows[name]
    for name in ("fp8-tensorwise", "fp8-rowwise"):  # no float8 on CPU: refused with the reason, or not built yet
        assert rows[name]["seconds"] is not None or rows[name]["note"].startswith(("refused:", "skipped:"))
    assert rows["fsdp2"]["note"].startswith("skipped")
    assert "| ours-fit-compile |" in done.stdout and "vs hf-compiled" in done.stdout
    bench_rows = {r["measure"]: r for r in json.loads(rows_out.read_text())}  # what `make bench` gathers
    assert bench_rows["GPU training: ours-fit-compile tokens/s"]["target"] == 1.2
    assert bench_rows["GPU training: ours-plain tokens/s"]["ratio"] > 0
