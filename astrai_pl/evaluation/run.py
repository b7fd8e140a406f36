"""`astrai-pl evaluate`: lm-eval tasks on a model through the engine; results in lm-eval's format.

    astrai-pl evaluate --model hf_dir/ --tasks astrai_arithmetic,astrai_next_sentence --output results.json
    astrai-pl evaluate --model last.ckpt --tasks my_task --include-path my_tasks/ --trust-task-code --limit 100

A model whose tokenizer has a chat template is asked through it (one line says so; `--no-chat-template`: plain
text), as `generate` does and as the SFT/DPO/GRPO data present their questions. The shipped tasks (astrai_pl/eval_tasks/) are found by name; `--include-path` adds folders of lm-eval task
YAML files; they are code (lm-eval renders their templates unsandboxed), so `--trust-task-code` must say that
you trust them. The results file is lm-eval's results dictionary (what `lm_eval --output_path` writes), written
to a temporary file and renamed over the target, so it is complete or absent; the table is printed.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from ..atomic import write_atomically
from ..commands import USER_ERRORS, _add_model_arguments
from ..warning_filters import is_terminal
from .lm import AstraiLM
from .tasks import SHIPPED, TaskError, check_task_folders, local_task_configs, task_specs


def evaluate(lm: AstraiLM, tasks: Sequence[str | dict[str, Any]], *, include_path: Sequence[str | Path] = (),
             num_fewshot: int | None = None, limit: int | float | None = None, apply_chat_template: bool = False,
             log_samples: bool = False, seed: int = 0, trust_task_code: bool = False) -> dict[str, Any]:
    """`lm_eval.simple_evaluate` on `lm` (any lm-eval `LM`) with the shipped tasks and those of `include_path`
    found by name; a task may also be given as a config dict (e.g. `local_copy`'s). A folder in `include_path`
    that is not shipped with the package is code, refused unless `trust_task_code` (tasks.check_task_folders)."""
    from lm_eval import simple_evaluate

    if not tasks:
        raise TaskError("no task given; name at least one (e.g. astrai_arithmetic)")
    check_task_folders(include_path, trust_task_code)
    specs = task_specs(tasks, include_path)
    # lm-eval's own ~15k task files take ~20 s to index: only when a name is not one of the local tasks
    manager = task_manager(tuple(map(str, include_path)), any(isinstance(s, str) for s in specs))
    with _environment_without_subprocesses(), _bars_off_unless_terminal():
        return simple_evaluate(
            model=lm, tasks=specs, num_fewshot=num_fewshot, limit=limit, task_manager=manager,
            apply_chat_template=apply_chat_template, log_samples=log_samples,
            random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed,
        )  # fmt: skip


@contextlib.contextmanager
def _environment_without_subprocesses():
    """lm-eval records the environment in its results with torch's collect_env, which runs pip, conda,
    nvidia-smi and others in subprocesses (about 7 s a call, paid by every evaluation in training and in the
    demo): inside this block it records the same keys from what this process already knows."""
    import lm_eval.evaluator as evaluator

    original, evaluator.add_env_info = evaluator.add_env_info, _add_environment
    try:
        yield
    finally:
        evaluator.add_env_info = original


@contextlib.contextmanager
def _bars_off_unless_terminal():
    """lm-eval's bar over each task's documents and `datasets`' bars (loading the task's rows) off inside this
    block when stderr is not a terminal: they redraw one line with carriage returns, which fills a log."""
    if is_terminal(sys.stderr):
        yield
        return
    import lm_eval.api.task as task
    from datasets import config
    from datasets.utils.tqdm import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    bar, datasets_were_off = task.tqdm, are_progress_bars_disabled()
    task.tqdm = functools.partial(bar, disable=True)
    if config.HF_DATASETS_DISABLE_PROGRESS_BARS is not False:  # not the user's explicit "on"
        disable_progress_bars()
    try:
        yield
    finally:
        task.tqdm = bar
        if not datasets_were_off:
            enable_progress_bars()


def _add_environment(storage: dict[str, Any]) -> None:
    """lm-eval's environment keys: versions and the platform, nothing that needs a subprocess."""
    import platform
    from importlib.metadata import version

    import torch
    import transformers

    cuda = torch.version.cuda or "none"
    storage.update(
        pretty_env_info=(f"torch {torch.__version__} (CUDA {cuda}), Python {platform.python_version()}, "
                         f"{platform.platform()}, {platform.processor() or platform.machine()}"),
        transformers_version=transformers.__version__, lm_eval_version=version("lm_eval"), upper_git_hash=None,
    )


@functools.lru_cache(maxsize=4)
def task_manager(include_path: tuple[str, ...], include_defaults: bool):
    """lm-eval's task index over the shipped folder and `include_path` (and lm-eval's own tasks), built once."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=[str(SHIPPED), *include_path], include_defaults=include_defaults)


def results_json(results: dict[str, Any]) -> str:
    """lm-eval's results as JSON, without the per-sample records (as `lm_eval --output_path` writes them)."""
    from lm_eval.utils import handle_non_serializable

    kept = {k: v for k, v in results.items() if k != "samples"}
    return json.dumps(kept, indent=2, default=handle_non_serializable, ensure_ascii=False)


def results_table(results: dict[str, Any]) -> str:
    from lm_eval.utils import make_table

    table = make_table(results)
    return table + ("\n" + make_table(results, "groups") if results.get("groups") else "")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="astrai-pl evaluate",
        description="Run lm-evaluation-harness tasks on a model through the inference engine.")
    _add_model_arguments(parser)
    shipped = ", ".join(sorted(local_task_configs([SHIPPED])))
    parser.add_argument("--tasks", required=True,
                        help=f"comma-separated task names: shipped ({shipped}), from --include-path, or lm-eval's own")
    parser.add_argument("--include-path", action="append", default=[],
                        help="a folder of lm-eval task YAML files; repeat for several (needs --trust-task-code)")
    parser.add_argument("--trust-task-code", action="store_true",
                        help="read --include-path folders: their task files are code (lm-eval renders their "
                             "templates unsandboxed and imports their !function tags); only for folders you trust")
    parser.add_argument("--num-fewshot", type=int, default=None)
    parser.add_argument("--limit", type=float, default=None,
                        help="documents per task (a number >= 1) or a share of them (below 1)")
    parser.add_argument("--batch-size", default=None,
                        help="accepted for lm-eval's command lines; the engine batches every request itself")
    parser.add_argument("--chat-template", "--apply-chat-template", action=argparse.BooleanOptionalAction,
                        default=None, dest="chat_template",
                        help="render each prompt (few-shot turns included) with the tokenizer's chat template. "
                             "Default: when the tokenizer has one (--no-chat-template: plain text)")
    parser.add_argument("--seed", type=int, default=0, help="seeds lm-eval's few-shot sampling and shuffles")
    parser.add_argument("--output", default=None, help="write lm-eval's results JSON here")
    return parser


def _check(ns: argparse.Namespace) -> list[str]:
    tasks = [t.strip() for t in ns.tasks.split(",") if t.strip()]
    if not tasks:
        raise TaskError(f"--tasks {ns.tasks!r} names no task; give comma-separated names")
    for folder in ns.include_path:
        if not Path(folder).is_dir():
            raise TaskError(f"--include-path {folder} is not a folder; give a folder of lm-eval task YAML files")
    check_task_folders(ns.include_path, ns.trust_task_code)
    if ns.limit is not None and not (ns.limit > 0 and (ns.limit < 1 or ns.limit == int(ns.limit))):
        raise TaskError(f"--limit {ns.limit:g}: give a whole number of documents or a share in (0, 1)")
    if ns.num_fewshot is not None and ns.num_fewshot < 0:
        raise TaskError(f"--num-fewshot {ns.num_fewshot}: give 0 or more")
    if ns.limit is not None and ns.limit >= 1:
        ns.limit = int(ns.limit)
    return tasks


def _templates_prompts(choice: bool | None, lm: AstraiLM, stdout: IO[str]) -> bool:
    """Whether prompts go through the chat template: as `--[no-]chat-template` says, else when the tokenizer has
    one, which one line on `stdout` then says."""
    has_template = lm.tokenizer.chat_template is not None
    if choice and not has_template:
        raise TaskError("--chat-template: the tokenizer has no chat template; pass --tokenizer DIR with one, "
                        "or leave the flag out")
    if choice is None and has_template:
        stdout.write("astrai-pl evaluate: prompts go through the tokenizer's chat template "
                     "(--no-chat-template: plain text)\n")
    return has_template if choice is None else choice


def evaluate_verb(argv: list[str], stdout: IO[str] | None = None) -> dict[str, Any]:
    """`astrai-pl evaluate`: print lm-eval's table and write its results JSON to --output."""
    ns = _parser().parse_args(argv)
    stdout = stdout or sys.stdout
    try:
        tasks = _check(ns)
        lm = AstraiLM.from_pretrained(ns.model, ns.adapter, tokenizer=ns.tokenizer, device=ns.device,
                                      dtype=ns.dtype, max_total_tokens=ns.max_total_tokens)
        templated = _templates_prompts(ns.chat_template, lm, stdout)
        results = evaluate(lm, tasks, include_path=ns.include_path, num_fewshot=ns.num_fewshot, limit=ns.limit,
                           apply_chat_template=templated, seed=ns.seed,
                           trust_task_code=ns.trust_task_code)
    except (*USER_ERRORS, TaskError, KeyError) as err:
        raise SystemExit(f"astrai-pl evaluate: {err}") from None
    if ns.output is not None:
        text = results_json(results)
        write_atomically(Path(ns.output), lambda f: f.write(text.encode("utf-8")))
    stdout.write(results_table(results) + "\n")
    if ns.output is not None:
        stdout.write(f"wrote {ns.output}\n")
    return results
