"""The demo's tables: lm-eval's results as (task, metric, value, stderr, documents) rows, and the table of the
stages at the end, on fixed inputs; and its thread count against the cores it may use."""

import os

import pytest

from astrai_pl.demo import StageRecord, demo_threads, evaluation_rows, evaluation_table, stage_table

RESULTS = {  # the shape lm_eval.simple_evaluate returns
    "results": {
        "astrai_arithmetic_small": {"alias": "astrai_arithmetic_small", "exact_match,last_integer": 0.8125,
                                    "exact_match_stderr,last_integer": 0.0569, "sample_len": 48},
        "astrai_next_sentence": {"alias": "astrai_next_sentence", "acc,none": 0.5, "acc_stderr,none": 0.0479,
                                 "acc_norm,none": 0.4545, "acc_norm_stderr,none": "N/A"},
    },
    "n-samples": {"astrai_arithmetic_small": {"original": 48, "effective": 48},
                  "astrai_next_sentence": {"original": 110, "effective": 110}},
}


def test_results_become_one_row_per_metric_with_its_stderr():
    assert evaluation_rows(RESULTS) == [
        ["astrai_arithmetic_small", "exact_match (last_integer)", 0.8125, 0.0569, 48],
        ["astrai_next_sentence", "acc", 0.5, 0.0479, 110],
        ["astrai_next_sentence", "acc_norm", 0.4545, "n/a", 110],
    ]


def test_the_evaluation_table_aligns_its_columns():
    lines = evaluation_table(evaluation_rows(RESULTS)).splitlines()
    assert lines[0].split() == ["task", "metric", "value", "stderr", "documents"]
    assert set(lines[1].replace(" ", "")) == {"-"}
    assert lines[2].split() == ["astrai_arithmetic_small", "exact_match", "(last_integer)", "0.8125", "0.0569", "48"]
    assert lines[4].split()[-3:] == ["0.4545", "n/a", "110"]
    value = lines[0].index("value") + len("value")  # numbers right-aligned under their header
    assert all(line[:value].endswith(("0.8125", "0.5", "0.4545")) for line in lines[2:])


def test_the_stage_table_has_a_row_per_stage_and_a_column_per_metric():
    rows = evaluation_rows(RESULTS)
    records = [
        StageRecord("pretrain", "loss 5.686 -> 2.028", "ppl 294.8 -> 7.6", 81.4, 160, 21_432.7, 6.2, rows[1:]),
        StageRecord("sft", "accuracy 0.0% -> 73.5%", "200 held-out problems", 150.6, 800, 9_876.0, 7.9, rows),
        StageRecord("generate", "accuracy 75.5%", "200 problems", 3.2),
    ]
    lines = stage_table(records).splitlines()
    assert lines[0].split() == ["stage", "held-out", "time", "(s)", "steps", "tokens/s", "eval", "(s)",
                                "next_sentence", "acc", "next_sentence", "acc_norm",
                                "arithmetic_small", "exact_match", "result"]
    assert lines[2].split() == ["pretrain", "loss", "5.686", "->", "2.028", "81", "160", "21433", "6", "0.5",
                                "0.4545", "ppl", "294.8", "->", "7.6"]
    assert lines[3].split() == ["sft", "accuracy", "0.0%", "->", "73.5%", "151", "800", "9876", "8", "0.5",
                                "0.4545", "0.8125", "200", "held-out", "problems"]
    assert lines[4].split() == ["generate", "accuracy", "75.5%", "3", "200", "problems"]


@pytest.mark.parametrize("requested, cores, threads", [("2", {0}, 1), ("1", {0, 1}, 1), ("", {0, 1, 2}, 3),
                                                       ("4,2", {0, 1}, 2), ("junk", {0, 1}, 2)])
def test_the_demo_never_runs_more_threads_than_its_cores(monkeypatch, requested, cores, threads):
    monkeypatch.setenv("OMP_NUM_THREADS", requested)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: cores)
    assert demo_threads() == threads
