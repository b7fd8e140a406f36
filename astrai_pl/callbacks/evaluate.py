"""lm-eval tasks while training: every N optimizer steps and when training ends, the model being trained is
evaluated through the inference engine (astrai_pl/evaluation) and every metric goes to the run's loggers, as
`eval/<task>/<metric>` (and, to loggers that take tables — W&B's — a table of the evaluated samples).

It runs on rank 0 alone, on the module's own (unsharded) model; the other ranks wait at the strategy's
barrier, and rank 0 then broadcasts whether it failed, so a failed evaluation stops every rank with the
error instead of leaving them waiting for one that has gone. Under FSDP2 or tensor parallelism no rank holds
the whole model: evaluate the exported checkpoint with `astrai-pl evaluate` instead.

    trainer:
      callbacks:
        - class_path: astrai_pl.callbacks.evaluate.Evaluate   # imports lm-eval only when configured
          init_args: {tasks: [astrai_arithmetic], every_n_steps: 200, limit: 100, apply_chat_template: true}
"""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import torch

from ..evaluation import AstraiLM, evaluate
from ..evaluation.lm import widen_steps
from ..evaluation.tasks import check_task_folders
from ..inference import Engine

SAMPLE_COLUMNS = ["step", "task", "doc_id", "prompt", "response", "target"]


class EvaluationError(RuntimeError):
    """The evaluation on rank 0 failed; every rank stops with its message."""


def metric_values(results: dict[str, Any], prefix: str = "eval") -> dict[str, float]:
    """lm-eval's results as flat numbers: {"eval/astrai_arithmetic/exact_match/last_integer": 0.4, …}; a
    filter named "none" is left out of the name, values that are not numbers (an alias, "N/A") are dropped."""
    metrics = {}
    for task, values in results.get("results", {}).items():
        for key, value in values.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                continue
            name, _, filtered = key.partition(",")
            metrics[f"{prefix}/{task}/{name}" + (f"/{filtered}" if filtered and filtered != "none" else "")] = \
                float(value)
    return metrics


def sample_rows(results: dict[str, Any], step: int) -> list[list[Any]]:
    """One row per evaluated document (SAMPLE_COLUMNS): its prompt, the model's answer (the text generated, or
    the index of the likeliest choice) and the target."""
    rows = []
    for task, samples in results.get("samples", {}).items():
        for sample in samples:
            responses = sample["filtered_resps"]
            if responses and isinstance(responses[0], (tuple, list)):
                scores = [r[0] for r in responses]
                response: Any = scores.index(max(scores))
            else:
                response = responses[0] if responses else ""
            rows.append([step, task, sample["doc_id"], str(sample["arguments"][0][0]), str(response),
                         str(sample["target"])])
    return rows


class Evaluate(L.Callback):
    """Run lm-eval tasks on the model being trained every `every_n_steps` optimizer steps and at the end.

    Args:
        tasks: Task names: shipped (astrai_arithmetic, astrai_next_sentence), from `include_path`, or lm-eval's.
        every_n_steps: Optimizer steps between two evaluations; None evaluates only when training ends.
        limit: Documents per task (a share when below 1); None evaluates every document.
        num_fewshot: Few-shot examples per prompt; None keeps each task's own.
        apply_chat_template: Render prompts with the tokenizer's chat template (as SFT/DPO/GRPO data are).
        include_path: Folders of lm-eval task YAML files (code: they need `trust_task_code`).
        trust_task_code: Read `include_path`: lm-eval renders their templates unsandboxed and imports their
            `!function` tags, so only folders you trust.
        max_total_tokens: KV pool of the evaluation's engine, in tokens (freed after each evaluation).
        log_samples: Also log a table of the evaluated samples to loggers that take tables (W&B's).
        prefix: Start of every metric's name.
    """

    def __init__(self, tasks: list[str], every_n_steps: int | None = None, limit: int | float | None = 100,
                 num_fewshot: int | None = None, apply_chat_template: bool = False,
                 include_path: list[str] | None = None, max_total_tokens: int = 16384, log_samples: bool = True,
                 prefix: str = "eval", trust_task_code: bool = False):
        if not tasks or not all(isinstance(t, str) and t for t in tasks):
            raise ValueError(f"Evaluate.tasks={tasks!r}: name at least one task, e.g. [astrai_arithmetic]")
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"Evaluate.every_n_steps={every_n_steps}: give 1 or more, or null to evaluate "
                             "only when training ends")
        if limit is not None and not limit > 0:
            raise ValueError(f"Evaluate.limit={limit}: give a number of documents, a share in (0, 1), or null")
        self.tasks, self.every_n_steps, self.limit, self.num_fewshot = list(tasks), every_n_steps, limit, num_fewshot
        self.apply_chat_template, self.include_path = apply_chat_template, list(include_path or [])
        check_task_folders(self.include_path, trust_task_code)
        self.trust_task_code = trust_task_code
        self.max_total_tokens, self.log_samples, self.prefix = max_total_tokens, log_samples, prefix
        self.history: list[dict[str, float]] = []  # rank 0: the metrics of each evaluation, with "step"
        self._step_seen = -1

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._step_seen = trainer.global_step

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        step = trainer.global_step
        if self.every_n_steps and step != self._step_seen and step % self.every_n_steps == 0:
            self.run(trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_step != self._step_seen:
            self.run(trainer, pl_module)

    def run(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Evaluate on rank 0 while the others wait; then every rank learns whether it failed."""
        step, error, failure = trainer.global_step, None, None
        self._step_seen = step
        if trainer.is_global_zero:
            try:
                self._log(trainer, self.evaluate(pl_module), step)
            except Exception as err:  # re-raised below, on every rank
                error, failure = f"{type(err).__name__}: {err}", err
        trainer.strategy.barrier("astrai_pl.Evaluate")
        error = trainer.strategy.broadcast(error, src=0)
        if error is not None:
            raise EvaluationError(f"Evaluate at step {step} failed on rank 0: {error}") from failure

    def evaluate(self, pl_module: L.LightningModule) -> dict[str, Any]:
        """lm-eval's results for the module's model as it is now (put back in training mode afterwards)."""
        model, tokenizer = pl_module.model, pl_module.tokenizer
        if any(type(p).__name__ == "DTensor" for p in model.parameters()):
            raise EvaluationError("the model is sharded (FSDP2 or tensor parallel), so rank 0 alone cannot run "
                                  "it; evaluate the exported checkpoint with astrai-pl evaluate, or train with DDP")
        was_training = model.training
        model.eval()
        try:
            with torch.inference_mode(False):
                engine = widen_steps(Engine(model, tokenizer, max_total_tokens=self.max_total_tokens))
            lm = AstraiLM(engine, tokenizer, name=type(pl_module).__name__)
            return evaluate(lm, self.tasks, include_path=self.include_path, num_fewshot=self.num_fewshot,
                            limit=self.limit, apply_chat_template=self.apply_chat_template,
                            log_samples=self.log_samples, trust_task_code=self.trust_task_code)
        finally:
            model.train(was_training)

    def _log(self, trainer: L.Trainer, results: dict[str, Any], step: int) -> None:
        metrics = metric_values(results, self.prefix)
        self.history.append({"step": step, **metrics})
        rows = sample_rows(results, step) if self.log_samples else []
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
            if rows and hasattr(logger, "log_table"):
                logger.log_table(key=f"{self.prefix}/samples", columns=SAMPLE_COLUMNS, data=rows, step=step)
