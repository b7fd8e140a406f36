"""benchmarks/bench_speculative.py --dry-run: the three workloads measured on the debug preset, and speculation's
greedy tokens the same as plain decoding's."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_speculative import main  # noqa: E402


def test_dry_run_prints_every_workload(capsys):
    assert main(["--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line.split() for line in lines[2:]}
    assert set(rows) == {"copies", "edited", "rejected", "free"}
    assert all(row[-1] == "True" for row in rows.values())  # the same tokens with and without speculation
    assert float(rows["copies"][5].rstrip("%")) > 0 and float(rows["copies"][4]) > 0  # the copying workload's drafts are accepted
