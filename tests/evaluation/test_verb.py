"""`astrai-pl evaluate`, the shipped tasks, local tasks, and generate_until's stops."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from lm_eval.api.instance import Instance

from astrai_pl.cli import main
from astrai_pl.evaluation import SHIPPED, local_copy, task_specs
from astrai_pl.evaluation.run import evaluate, evaluate_verb
from astrai_pl.evaluation.tasks import arithmetic_rows, next_sentence_rows


def test_the_verb_writes_lm_evals_results_and_prints_the_table(hf_dir, tmp_path):
    out, stdout = tmp_path / "results.json", io.StringIO()
    evaluate_verb(["--model", str(hf_dir), "--tasks", "astrai_arithmetic,astrai_next_sentence", "--limit", "3",
                   "--max-total-tokens", "4096", "--output", str(out)], stdout=stdout)
    results = json.loads(out.read_text())
    assert set(results["results"]) == {"astrai_arithmetic", "astrai_next_sentence"}
    assert 0 <= results["results"]["astrai_arithmetic"]["exact_match,last_integer"] <= 1
    assert {"acc,none", "acc_norm,none"} <= set(results["results"]["astrai_next_sentence"])
    assert results["n-samples"]["astrai_next_sentence"]["effective"] == 3
    assert "samples" not in results and not list(tmp_path.glob(".*"))  # no temporary file left behind
    assert "astrai_next_sentence" in stdout.getvalue() and "exact_match" in stdout.getvalue()


@pytest.mark.parametrize("argv, message", [
    (["--tasks", " , "], "names no task"),
    (["--tasks", "astrai_arithmetic", "--include-path", "/nonexistent"], "is not a folder"),
    (["--tasks", "astrai_arithmetic", "--limit", "2.5"], "--limit 2.5"),
    pytest.param(["--tasks", "no_such_task_anywhere"], "no_such_task_anywhere", marks=pytest.mark.slow),
])
def test_bad_arguments_are_refused_naming_them(hf_dir, argv, message):
    with pytest.raises(SystemExit, match=message):
        main(["evaluate", "--model", str(hf_dir), "--max-total-tokens", "2048", *argv])


def test_an_included_local_task_is_found_by_name_from_any_directory(ours, tmp_path, monkeypatch):
    folder = tmp_path / "tasks"
    folder.mkdir()
    (folder / "rows.jsonl").write_text(json.dumps({"q": "Say hi", "a": "hi"}) + "\n")
    (folder / "mine.yaml").write_text(
        "task: my_local\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: rows.jsonl\n"
        "test_split: test\noutput_type: loglikelihood\ndoc_to_text: '{{q}}'\ndoc_to_target: '{{a}}'\n"
        "metric_list:\n  - metric: perplexity\n")
    monkeypatch.chdir(tmp_path.parent)  # data_files resolve against the YAML file's folder, not here
    [spec] = task_specs(["my_local"], [folder])
    assert spec["dataset_kwargs"]["data_files"]["test"] == str(folder / "rows.jsonl")
    from astrai_pl.evaluation import evaluate

    results = evaluate(ours, ["my_local"], include_path=[folder], trust_task_code=True)
    assert results["results"]["my_local"]["perplexity,none"] > 1


def test_a_missing_data_file_is_named(tmp_path):
    (tmp_path / "bad.yaml").write_text("task: bad\ndataset_path: json\ndataset_kwargs:\n  data_files: nope.jsonl\n")
    with pytest.raises(ValueError, match="nope.jsonl does not exist"):
        task_specs(["bad"], [tmp_path])


@pytest.mark.slow  # indexing lm-eval's own tasks takes ~20 s
def test_local_copy_runs_a_registered_lm_eval_task_on_local_rows(ours, tmp_path):
    """The way to run any of lm-eval's tasks offline: its YAML config, with the rows from a local file."""
    from astrai_pl.evaluation import evaluate
    from astrai_pl.evaluation.run import task_manager

    rows = tmp_path / "wikitext.jsonl"
    rows.write_text(json.dumps({"page": "A short page of text.\n"}) + "\n")
    spec = local_copy("wikitext", {"test": rows}, task_manager((), True))
    assert spec["dataset_path"] == "json" and spec["task"] == "wikitext"
    spec.update(validation_split=None, training_split=None, fewshot_split=None)
    results = evaluate(ours, [spec])
    assert results["results"]["wikitext"]["word_perplexity,none"] > 1


def _until(ours, context, **gen_kwargs):
    [text] = ours.generate_until([Instance("generate_until", {}, (context, gen_kwargs), 0)])
    return text


def test_generate_until_stops_at_the_first_stop_string_and_at_max_gen_toks(ours):
    free = _until(ours, "What is", until=[], max_gen_toks=12)
    stop = next(c for c in free[1:] if c.isprintable() and c != "\ufffd")
    cut = _until(ours, "What is", until=[stop], max_gen_toks=12)
    assert cut == free[:free.index(stop)] and len(cut) < len(free)
    assert len(ours.tok_encode(_until(ours, "What is", until=[], max_gen_toks=3), add_special_tokens=False)) <= 3


def test_shipped_rows_are_deterministic_and_well_formed():
    assert arithmetic_rows(20) == arithmetic_rows(20)
    docs = [{"title": f"d{i}", "text": f"Sentence number {i} opens the text here. It goes on with more words "
             f"about {i}. Then a third sentence closes document {i}."} for i in range(6)]
    rows = next_sentence_rows(docs, n=10)
    assert rows == next_sentence_rows(docs, n=10) and rows
    for row in rows:
        assert len(row["choices"]) == 4 and len(set(row["choices"])) == 4
        truth = row["choices"][row["label"]]
        assert row["title"] in truth.replace("document ", "d").replace("about ", "d") or truth.startswith("It")
    shipped = [json.loads(line) for line in (SHIPPED / "next_sentence.jsonl").read_text().splitlines()]
    assert len(shipped) >= 100 and all(0 <= r["label"] < 4 and len(r["choices"]) == 4 for r in shipped)


def test_the_chat_template_renders_as_transformers_does_for_lm_eval(ours, hf_dir):
    import transformers

    hf = transformers.AutoTokenizer.from_pretrained(hf_dir)
    turns = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "It is"}]
    assert ours.apply_chat_template(turns[:1]) == hf.apply_chat_template(
        turns[:1], tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(turns, add_generation_prompt=False) == hf.apply_chat_template(
        turns, tokenize=False, add_generation_prompt=False, continue_final_message=True)
    assert ours.chat_template(True) == ours.tokenizer.chat_template and ours.chat_template(False) is None


def test_the_small_arithmetic_task_is_the_tiny_configs_held_out_range():
    """astrai_arithmetic_small: every held-out problem of the operand range the shipped tiny configs train on,
    none of them in training, and the shipped file is what the generator gives."""
    import yaml

    from astrai_pl.data.synthetic import problems
    from astrai_pl.evaluation.tasks import small_arithmetic_rows

    config = yaml.safe_load((Path(__file__).parents[2] / "configs/sft/tiny.yaml").read_text())
    rows = small_arithmetic_rows(config["data"]["init_args"]["synthetic"]["max_operand"])
    shipped = [json.loads(line) for line in (SHIPPED / "arithmetic_small.jsonl").read_text().splitlines()]
    assert rows == shipped and len(rows) == 48
    train = {p.question for p in problems(5000, split="train", max_operand=14)}
    assert not train & {r["question"] for r in rows}
    assert all(max(int(n) for n in r["question"][8:-1].split(" ")[::2]) <= 14 for r in rows)


def test_results_record_the_environment_without_running_collect_env(ours, monkeypatch):
    import torch.utils.collect_env as collect_env

    def refuse():
        raise AssertionError("collect_env runs pip, conda and nvidia-smi in subprocesses")

    monkeypatch.setattr(collect_env, "get_pretty_env_info", refuse)
    results = evaluate(ours, ["astrai_arithmetic_small"], limit=2)
    assert torch.__version__ in results["pretty_env_info"]
    assert results["transformers_version"] and results["lm_eval_version"]
    assert "astrai_arithmetic_small" in results["results"]


def _chat_template_run(hf_dir, monkeypatch, *flags):
    """What the verb prints and the apply_chat_template it hands lm-eval (the run itself is lm-eval's)."""
    import astrai_pl.evaluation.run as run

    seen, stdout = [], io.StringIO()
    real = run.evaluate
    monkeypatch.setattr(run, "evaluate", lambda *a, **kw: seen.append(kw["apply_chat_template"]) or real(*a, **kw))
    evaluate_verb(["--model", str(hf_dir), "--tasks", "astrai_arithmetic_small", "--limit", "1",
                   "--max-total-tokens", "2048", *flags], stdout=stdout)
    return seen, stdout.getvalue()


def test_a_model_with_a_chat_template_is_asked_through_it_unless_told_not_to(hf_dir, monkeypatch):
    seen, printed = _chat_template_run(hf_dir, monkeypatch)
    assert seen == [True] and "chat template (--no-chat-template: plain text)" in printed
    assert printed.count("chat template") == 1
    seen, printed = _chat_template_run(hf_dir, monkeypatch, "--no-chat-template")
    assert seen == [False] and "chat template" not in printed
    seen, printed = _chat_template_run(hf_dir, monkeypatch, "--apply-chat-template")  # lm-eval's spelling
    assert seen == [True] and "chat template" not in printed  # asked for: nothing to announce


def test_asking_for_a_chat_template_the_tokenizer_lacks_is_refused(hf_dir, tmp_path):
    plain = tmp_path / "plain"
    plain.mkdir()
    for f in hf_dir.iterdir():
        (plain / f.name).write_bytes(f.read_bytes())
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(SystemExit, match="no chat template"):
        main(["evaluate", "--model", str(plain), "--tasks", "astrai_arithmetic_small", "--chat-template",
              "--max-total-tokens", "2048"])


def test_the_help_lists_every_shipped_task(capsys):
    with pytest.raises(SystemExit):
        main(["evaluate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    names = sorted(p.stem for p in SHIPPED.glob("*.yaml"))
    assert "astrai_arithmetic_small" in names
    assert all(name in text for name in names)


def test_no_progress_bar_reaches_output_that_is_not_a_terminal(ours, tmp_path, monkeypatch, capfd):
    """lm-eval's bar and datasets' bar loading a task's rows (forced here by an empty datasets cache) redraw one
    line with carriage returns; captured stderr is no terminal, so neither shows."""
    import datasets.config
    from datasets.utils.tqdm import are_progress_bars_disabled

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    was_off = are_progress_bars_disabled()
    capfd.readouterr()
    evaluate(ours, ["astrai_arithmetic_small"], limit=2)
    err = capfd.readouterr().err
    assert "\r" not in err and "it/s" not in err and "examples/s" not in err, err[-500:]
    assert are_progress_bars_disabled() == was_off  # left as it was found


def test_a_terminal_keeps_lm_evals_bar(ours, tmp_path, monkeypatch, capfd):
    import sys as _sys

    monkeypatch.setattr(_sys.stderr, "isatty", lambda: True, raising=False)
    capfd.readouterr()
    evaluate(ours, ["astrai_arithmetic_small"], limit=2)
    assert "it/s" in capfd.readouterr().err  # the bar the test above does not see
