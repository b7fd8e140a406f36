"""Sample generations while training: greedy completions of a few fixed prompts every N optimizer steps, with
their reward, logged as a table (step / prompt / completion / reward) to every logger that takes tables (W&B's).

The prompts are given, or the data module's held-out arithmetic problems. A problem's reward is the
objective's own weighted reward when it has reward functions (GRPO), else the exact match of the completion
with the problem's answer; a given prompt has no answer and no reward. Decoding is `greedy_decode`, the loop of
the greedy evaluation (objectives/evaluation.py). It runs on every rank, since the forward of a sharded model
needs all of them; rank 0 logs. The `wandb:` section of a config adds this callback (tracking.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import lightning as L

from ..data.synthetic import exact_match
from ..objectives.evaluation import chat_prompts, greedy_decode
from ..objectives.rewards import score

COLUMNS = ["step", "prompt", "completion", "reward"]


@dataclass(frozen=True)
class Sample:
    prompt: str
    answer: str | None = None


def held_out_samples(datamodule: Any, n: int) -> list[Sample]:
    """The first `n` held-out arithmetic problems of a post-training data module on the built-in task."""
    name = type(datamodule).__name__ if datamodule is not None else "a fit without a data module"
    path = getattr(datamodule, "hparams", {}).get("path")
    if not hasattr(datamodule, "held_out_problems"):
        why = f"{name} has no held-out arithmetic problems"
    elif path is not None:
        why = f"{name} reads path={path!r}, so the built-in task's held-out problems do not apply"
    else:
        return [Sample(p.question, p.answer) for p in datamodule.held_out_problems(n)]
    raise ValueError(f"SampleGenerations.prompts (wandb.sample_prompts) is null and {why}; give the prompts "
                     "as a list of strings, or set wandb.samples_every_n_steps 0 to log no samples")


class SampleGenerations(L.Callback):
    """Every `every_n_steps` optimizer steps, complete the same prompts greedily and log them as a table.

    Args:
        every_n_steps: Optimizer steps between two tables.
        prompts: Prompts to complete; None = the data module's held-out arithmetic problems.
        num_prompts: How many held-out problems to complete (given prompts are all used).
        chat: Send each prompt as a user turn through the chat template (as SFT, DPO and GRPO data encode
            them); false = plain text.
        max_new_tokens: Most tokens generated per prompt.
        key: Name of the table in the logger.
    """

    def __init__(self, every_n_steps: int = 50, prompts: list[str] | None = None, num_prompts: int = 4,
                 chat: bool = True, max_new_tokens: int = 32, key: str = "samples"):
        if every_n_steps < 1 or num_prompts < 1 or max_new_tokens < 1:
            raise ValueError(f"SampleGenerations: every_n_steps={every_n_steps}, num_prompts={num_prompts} and "
                             f"max_new_tokens={max_new_tokens} must all be >= 1")
        empty = [i for i, p in enumerate(prompts or []) if not p]
        if empty:
            raise ValueError(f"SampleGenerations.prompts[{empty[0]}] is empty; every prompt needs some text")
        self.every_n_steps, self.num_prompts, self.chat = every_n_steps, num_prompts, chat
        self.max_new_tokens, self.key = max_new_tokens, key
        self.samples = [Sample(p) for p in prompts] if prompts else None
        self.rows: list[dict[str, Any]] = []  # every row logged so far, oldest first
        self._step_seen = -1

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit" and self.samples is None:
            self.samples = held_out_samples(trainer.datamodule, self.num_prompts)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._step_seen = trainer.global_step  # a table is due when an optimizer step completes

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        step = trainer.global_step
        if step == self._step_seen or step % self.every_n_steps:
            return
        self._step_seen = step
        rows = [{"step": step, **row} for row in self.generate(pl_module)]
        self.rows += rows
        if trainer.is_global_zero:
            data = [[row[c] for c in COLUMNS] for row in rows]
            for logger in trainer.loggers:
                if hasattr(logger, "log_table"):
                    logger.log_table(key=self.key, columns=COLUMNS, data=data, step=step)

    def generate(self, pl_module: L.LightningModule) -> list[dict[str, Any]]:
        """prompt / completion / reward of each sample, under the module's current weights."""
        tokenizer, model = pl_module.tokenizer, pl_module.model
        texts = [s.prompt for s in self.samples]
        prompt_ids = chat_prompts(texts, tokenizer) if self.chat else [tokenizer.encode(t) for t in texts]
        was_training = model.training
        model.eval()
        try:
            ids = greedy_decode(model, prompt_ids, tokenizer.eos_token_ids, tokenizer.pad_token_id,
                                self.max_new_tokens)
        finally:
            model.train(was_training)
        completions = [tokenizer.decode(c, skip_special_tokens=True) for c in ids]
        rewards = self.rewards(pl_module, completions, ids)
        return [{"prompt": s.prompt, "completion": c, "reward": r}
                for s, c, r in zip(self.samples, completions, rewards)]

    def rewards(self, pl_module: L.LightningModule, completions: list[str], ids: list[list[int]]
                ) -> list[float | None]:
        """The objective's weighted reward (GRPO), else exact match with the answer; None without answers."""
        answers = [s.answer for s in self.samples]
        if all(a is None for a in answers):
            return [None] * len(completions)
        funcs = getattr(pl_module, "reward_funcs", None)
        if not funcs:
            return [exact_match(c, a) for c, a in zip(completions, answers)]
        prompts: list = [s.prompt for s in self.samples]
        shown: list = list(completions)
        if self.chat:  # conversational rows, as GRPO passes them to reward functions
            prompts = [[{"role": "user", "content": p}] for p in prompts]
            shown = [[{"role": "assistant", "content": c}] for c in completions]
        _, total = score(funcs, pl_module.reward_weights, prompts, shown,
                         {"answer": answers, "completion_ids": ids})
        return [float(r) for r in total]
