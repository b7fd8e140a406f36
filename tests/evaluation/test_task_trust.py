"""A folder of lm-eval task files from elsewhere is code: lm-eval renders its templates with an unsandboxed
jinja2, so `--include-path` is refused unless `--trust-task-code` says the user trusts it."""

from __future__ import annotations

import io
import json

import pytest

from astrai_pl.callbacks.evaluate import Evaluate
from astrai_pl.evaluation import SHIPPED, TaskError, evaluate
from astrai_pl.evaluation.run import evaluate_verb


def _task_folder(root, doc_to_text: str):
    folder = root / "tasks"
    folder.mkdir()
    (folder / "rows.jsonl").write_text(json.dumps({"q": "Say hi", "a": "hi"}) + "\n")
    (folder / "mine.yaml").write_text(
        "task: my_local\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: rows.jsonl\n"
        f"test_split: test\noutput_type: loglikelihood\ndoc_to_text: {json.dumps(doc_to_text)}\n"
        "doc_to_target: '{{a}}'\nmetric_list:\n  - metric: perplexity\n")
    return folder


def test_a_task_folder_that_runs_a_command_is_refused_without_the_flag(hf_dir, tmp_path):
    marker = tmp_path / "marker"
    template = "{{ cycler.__init__.__globals__.os.system('touch " + str(marker) + "') }}{{q}}"
    folder = _task_folder(tmp_path, template)
    argv = ["--model", str(hf_dir), "--tasks", "my_local", "--include-path", str(folder), "--limit", "1",
            "--max-total-tokens", "2048"]
    with pytest.raises(SystemExit, match=r"--include-path .*are code.*--trust-task-code"):
        evaluate_verb(argv, stdout=io.StringIO())
    assert not marker.exists()


def test_the_library_and_the_callback_refuse_it_too(ours, tmp_path):
    folder = _task_folder(tmp_path, "{{q}}")
    with pytest.raises(TaskError, match="trust_task_code=True"):
        evaluate(ours, ["my_local"], include_path=[folder], limit=1)
    with pytest.raises(TaskError, match="trust_task_code=True"):
        Evaluate(tasks=["my_local"], include_path=[str(folder)])
    Evaluate(tasks=["astrai_arithmetic"], include_path=[str(SHIPPED)])  # the shipped folder is ours


def test_with_the_flag_a_trusted_folder_is_evaluated(hf_dir, tmp_path):
    folder = _task_folder(tmp_path, "{{q}}")
    results = evaluate_verb(["--model", str(hf_dir), "--tasks", "my_local", "--include-path", str(folder),
                             "--trust-task-code", "--limit", "1", "--max-total-tokens", "2048"], stdout=io.StringIO())
    assert results["results"]["my_local"]["perplexity,none"] > 1
