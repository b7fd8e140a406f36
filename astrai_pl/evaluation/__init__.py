"""lm-evaluation-harness on the inference engine: `AstraiLM` (lm-eval's `LM`), the shipped tasks, and
`evaluate` (`lm_eval.simple_evaluate` with those tasks found by name). See docs/evaluation.md."""

from .lm import AstraiLM
from .run import evaluate, results_json, results_table
from .tasks import SHIPPED, TaskError, local_copy, task_specs

__all__ = ["SHIPPED", "AstraiLM", "TaskError", "evaluate", "local_copy", "results_json", "results_table",
           "task_specs"]
