"""benchmarks/bench_posttrain_online.py --dry-run: every duel (Distill vs GKD, Online DPO, RLOO, GRPO with
sequence-level ratios vs TRL's trainers) runs on the debug preset, and both sides sample and train the same
number of tokens (the script asserts it); the rows `make bench` gathers come out."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


@pytest.mark.slow  # TRL's four trainers are built and stepped: about a minute on two cores
def test_dry_run_steps_every_duel(tmp_path):
    pytest.importorskip("trl")
    from bench_posttrain_online import CASES, main

    out = tmp_path / "rows.json"
    assert main(["--dry-run", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert len(rows) == len(CASES)
    assert all(r["ratio"] > 0 and r["target"] == 1.3 for r in rows), rows
    assert [r["peer"].split()[2] for r in rows] == ["GKDTrainer", "OnlineDPOTrainer", "RLOOTrainer", "GRPOTrainer"]
