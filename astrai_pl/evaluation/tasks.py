"""The shipped lm-eval tasks (astrai_pl/eval_tasks/) and how task names become what lm-eval loads.

- `astrai_arithmetic`: the held-out problems of the built-in arithmetic task ("What is 37 + 48?"), answered
  by generation, scored by exact match of the last integer (data/synthetic.py's rule); operands 0..99.
- `astrai_arithmetic_small`: the same with operands 0..14, the range the shipped tiny configs train on (every
  one of its 48 held-out problems): the task that scores the demo's models.
- `astrai_next_sentence`: one or two sentences of a held-out document of the embedded corpus,
  and four sentences to continue it: the true next one and three from other documents (log-likelihood).

A folder of task files from elsewhere (`--include-path`) is code: lm-eval renders its templates with an
unsandboxed jinja2 and imports what its `!function` tags name, so it is read only under `--trust-task-code`.

Their YAML files name local JSONL data relative to themselves; lm-eval would read such a path relative to the
working directory, so `task_specs` hands lm-eval those tasks as configs with the path made absolute (read with
`yaml.safe_load`: nothing in them runs). The JSONL files are built by `write_shipped_data` (deterministic:
`python -m astrai_pl.evaluation.tasks` rewrites them) and shipped as package data.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import yaml

SHIPPED = Path(__file__).resolve().parent.parent / "eval_tasks"
ARITHMETIC_ROWS = 250
SMALL_OPERAND = 14  # configs/{sft,dpo,grpo}/tiny.yaml: synthetic.max_operand
NEXT_SENTENCE_ROWS = 250
SENTENCE = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")
MIN_SENTENCE, MAX_SENTENCE, MAX_CONTEXT = 30, 160, 320  # characters: every row fits a 512-token byte context
CONTEXT_SENTENCES, PER_DOCUMENT = 2, 6  # a context: the (up to) two sentences before; at most six rows a document
VAL_FRACTION = 0.02  # the pretraining configs' val_fraction: these documents are never trained on


class TaskError(ValueError):
    """A task name or task file that lm-eval cannot be given."""


def check_task_folders(folders: Iterable[str | Path], trust_task_code: bool) -> None:
    """TaskError for a folder of task files that is not one shipped with the package, unless `trust_task_code`:
    lm-eval renders a task's templates (doc_to_text, doc_to_target, …) with an unsandboxed jinja2 environment
    and imports the Python its `!function` tags name, so a task folder is code, whatever its YAML looks like."""
    if trust_task_code:
        return
    for folder in folders:
        resolved = Path(folder).resolve()
        if resolved != SHIPPED and SHIPPED not in resolved.parents:
            raise TaskError(
                f"--include-path {folder}: task folders not shipped with astrai_pl are code (lm-eval renders "
                "their templates with an unsandboxed jinja2 and imports the Python their !function tags name, so "
                "a task file can run any command). Fix: read the folder's files, and if you trust whoever wrote "
                "them pass --trust-task-code (trust_task_code=True in evaluate() or the Evaluate callback)")


# -- names -> what lm-eval loads ---------------------------------------------------------------------------
def local_task_configs(folders: Iterable[str | Path]) -> dict[str, dict[str, Any]]:
    """{task name: config} of every YAML file in `folders` that reads local JSON data (`dataset_path: json`),
    its relative data_files made absolute against the file's folder."""
    configs: dict[str, dict[str, Any]] = {}
    for folder in map(Path, folders):
        for path in sorted(folder.rglob("*.yaml")):
            try:
                cfg = yaml.safe_load(path.read_text(encoding="utf-8"))
            except (yaml.YAMLError, UnicodeDecodeError):
                continue  # lm-eval's own loader reads it (its tags, includes) and reports what is wrong
            if isinstance(cfg, dict) and cfg.get("dataset_path") == "json" and isinstance(cfg.get("task"), str):
                configs.setdefault(cfg["task"], _absolute_data_files(cfg, path))
    return configs


def _absolute_data_files(cfg: dict[str, Any], path: Path) -> dict[str, Any]:
    kwargs = dict(cfg.get("dataset_kwargs") or {})
    files = kwargs.get("data_files")
    if files is None:
        raise TaskError(f"{path}: dataset_path is json but dataset_kwargs.data_files is missing; name the JSONL "
                        "file(s), e.g. data_files: {test: rows.jsonl}")
    if isinstance(files, dict):
        resolved = {split: _resolve(f, path) for split, f in files.items()}
    else:
        resolved = _resolve(files, path)
    return {**cfg, "dataset_kwargs": {**kwargs, "data_files": resolved}}


def _resolve(files: str | list[str], path: Path) -> str | list[str]:
    if isinstance(files, list):
        return [_resolve(f, path) for f in files]
    if not isinstance(files, str):
        raise TaskError(f"{path}: data_files holds {files!r}; give a file name or a list of them")
    target = Path(files) if Path(files).is_absolute() else path.parent / files
    if not target.is_file():
        raise TaskError(f"{path}: data file {target} does not exist; write it or fix data_files")
    return str(target)


def task_specs(names: Sequence[str | dict[str, Any]], include_paths: Sequence[str | Path] = ()
               ) -> list[str | dict[str, Any]]:
    """What `lm_eval.simple_evaluate(tasks=…)` takes for each name: the config of a shipped or included task on
    local JSON data, else the name itself (lm-eval's registry, with `include_paths` added to it). A config
    (a dict) is passed on as it is."""
    local = local_task_configs([SHIPPED, *include_paths])
    return [name if isinstance(name, dict) else local.get(name, name) for name in names]


def local_copy(task: str, data_files: dict[str, str | Path], task_manager: Any = None) -> dict[str, Any]:
    """lm-eval's registered `task` with its data read from local JSON/JSONL files instead of the Hub
    ({split: path}, the splits the task names): a way to run any lm-eval task offline, e.g. in tests."""
    from lm_eval.tasks import TaskManager
    from lm_eval.tasks._yaml_loader import load_yaml

    manager = task_manager or TaskManager()
    entry = manager.task_index.get(task)
    if entry is None or entry.yaml_path is None:
        raise TaskError(f"{task!r} is not a task lm-eval defines in YAML; pick one of TaskManager().all_tasks")
    cfg = load_yaml(entry.yaml_path, resolve_func=True)
    cfg.pop("dataset_name", None)
    return {**cfg, "task": task, "dataset_path": "json",
            "dataset_kwargs": {"data_files": {split: str(Path(p).resolve()) for split, p in data_files.items()}}}


# -- the shipped data --------------------------------------------------------------------------------------
def arithmetic_rows(n: int = ARITHMETIC_ROWS, seed: int = 0) -> list[dict[str, str]]:
    """`n` distinct held-out problems of the built-in task (never in any training split) with their answers."""
    from ..data.synthetic import problems

    seen: dict[str, str] = {}
    for problem in problems(4 * n, split="test", seed=seed):
        seen.setdefault(problem.question, problem.answer)
    if len(seen) < n:
        raise TaskError(f"only {len(seen)} distinct held-out problems for {n} rows")
    return [{"question": q, "answer": a} for q, a in list(seen.items())[:n]]


def small_arithmetic_rows(max_operand: int = SMALL_OPERAND) -> list[dict[str, str]]:
    """Every held-out problem with operands in [0, max_operand] (+ and -), in a fixed order: the range the
    shipped tiny configs (and so the demo) train on, where `arithmetic_rows`' 0..99 lie outside it."""
    from ..data.synthetic import held_out_set

    return [{"question": p.question, "answer": p.answer} for p in held_out_set(("+", "-"), max_operand)]


def _sentences(text: str) -> list[str]:
    return SENTENCE.split(" ".join(text.split()))


def _fits(sentence: str) -> bool:
    return MIN_SENTENCE <= len(sentence) <= MAX_SENTENCE and sentence[-1] in ".!?"


def next_sentence_rows(documents: list[dict[str, str]], n: int = NEXT_SENTENCE_ROWS, seed: int = 0
                       ) -> list[dict[str, Any]]:
    """Up to `n` rows {title, context, choices (4 sentences), label} from `documents` ({title, text}): the
    context is one or two sentences of a document, the label the index of the sentence that follows them; the
    three others come from other documents. The same documents and seed give the same rows."""
    rng = random.Random(f"next-sentence:{seed}")
    candidates, pool = [], []
    for doc in documents:
        sentences = _sentences(doc["text"])
        found = []
        for k in range(1, len(sentences)):
            context = " ".join(sentences[max(0, k - CONTEXT_SENTENCES):k])
            if MIN_SENTENCE <= len(context) <= MAX_CONTEXT and _fits(sentences[k]):
                found.append((doc["title"], context, sentences[k]))
        candidates += rng.sample(found, min(PER_DOCUMENT, len(found)))
        pool += [(doc["title"], s) for s in sentences if _fits(s)]
    if len({title for title, _ in pool}) < 2:
        raise TaskError("next_sentence_rows needs sentences from at least two documents")
    rng.shuffle(candidates)
    rows = []
    for title, context, truth in candidates[:n]:
        others: list[str] = []
        while len(others) < 3:
            other_title, sentence = pool[rng.randrange(len(pool))]
            if other_title != title and sentence not in others and sentence != truth:
                others.append(sentence)
        label = rng.randrange(4)
        choices = others[:label] + [truth] + others[label:]
        rows.append({"title": title, "context": context, "choices": choices, "label": label})
    return rows


def held_out_documents() -> list[dict[str, str]]:
    """The embedded corpus's documents that pretraining holds out (configs/pretrain: val_fraction 0.02)."""
    from ..data.corpus import embedded_documents, is_held_out

    return [d for d in embedded_documents() if is_held_out(d["title"], VAL_FRACTION)]


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")


def write_shipped_data(folder: Path = SHIPPED) -> None:
    """Rebuild the shipped JSONL files from their generators."""
    _write_jsonl(folder / "arithmetic.jsonl", arithmetic_rows())
    _write_jsonl(folder / "arithmetic_small.jsonl", small_arithmetic_rows())
    _write_jsonl(folder / "next_sentence.jsonl", next_sentence_rows(held_out_documents()))


if __name__ == "__main__":
    write_shipped_data()
    print(f"wrote arithmetic.jsonl, arithmetic_small.jsonl and next_sentence.jsonl in {SHIPPED}")
