"""What a run shows on the console besides its own lines: a progress bar counted in optimizer steps and a model
summary without a FLOPs count. `astrai-pl fit` installs both where the config leaves Lightning's defaults on.

Lightning's bar counts batches against a total of `max_steps` (`10/5` with two batches per step), shows a
step-bounded run's epoch as `Epoch 0/-2` (max_epochs -1, minus one) and the logger's version as `v_num`; its
summary prints `Total FLOPs: 0`, since FLOPs are counted only for a module with an `example_input_array`.
Configs that name a progress bar or a model summary callback keep theirs. When standard output is not a
terminal (a log file, a pipe, a notebook's captured stream) a bar would print nothing readable, so plain
progress lines (progress.py, ProgressLines) take its place.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelSummary, ProgressBar, RichProgressBar
from lightning.pytorch.utilities.model_summary import get_formatted_model_size, get_human_readable_count

from .progress import ProgressLines

log = logging.getLogger("lightning.pytorch.callbacks.model_summary")  # where Lightning's summary is logged


def total_steps(trainer: L.Trainer) -> int | float:
    """The optimizer steps the whole run takes (a resumed run's total, not what is left): max_steps, or the steps
    of max_epochs epochs, whichever comes first; inf for an endless run."""
    return trainer.estimated_stepping_batches


class StepProgressBar(RichProgressBar):
    """Lightning's Rich bar counting optimizer steps (`5/5` for max_steps 5 at any accumulation), its epoch shown
    without a total when the run is bounded by steps, and no `v_num`."""

    @property
    def total_train_batches(self) -> int | float:
        return total_steps(self.trainer)

    def _get_train_description(self, current_epoch: int) -> str:
        epochs = self.trainer.max_epochs
        description = f"Epoch {current_epoch}" + (f"/{epochs - 1}" if epochs is not None and epochs > 0 else "")
        return f"{description:{len(self.validation_description)}}"  # as wide as "Validation": no flicker

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not self.is_disabled and self.train_progress_bar_id is None:
            self._initialize_train_progress_bar_id()  # a run resumed in the middle of an epoch
        self._update(self.train_progress_bar_id, trainer.global_step)
        self._update_metrics(trainer, pl_module)
        self.refresh()

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)  # the run directory, printed when the run starts, says which run this is
        return metrics


class ParameterSummary(ModelSummary):
    """Lightning's model summary (layers, parameters, size, modes) without the FLOPs column and total."""

    @staticmethod
    def summarize(summary_data: list[tuple[str, list[str]]], total_parameters: int, trainable_parameters: int,
                  model_size: float, total_training_modes: dict[str, int], total_flops: int,
                  **summarize_kwargs: Any) -> None:
        log.info("\n" + summary_table(summary_data, total_parameters, trainable_parameters, model_size,
                                      total_training_modes))


def summary_table(columns: list[tuple[str, list[str]]], total_parameters: int, trainable_parameters: int,
                  model_size: float, modes: dict[str, int]) -> str:
    """The layer table (every column but FLOPs) and the parameter totals, as plain text."""
    columns = [(name, [str(v) for v in values]) for name, values in columns if name != "FLOPs"]
    widths = [max([len(name), *map(len, values)]) for name, values in columns]
    rule = "-" * (sum(widths) + 3 * len(widths))
    rows = [" | ".join(f"{name:<{w}}" for (name, _), w in zip(columns, widths)), rule]
    rows += [" | ".join(f"{values[i]:<{w}}" for (_, values), w in zip(columns, widths))
             for i in range(len(columns[0][1]) if columns else 0)]
    totals = [
        (get_human_readable_count(trainable_parameters), "Trainable params"),
        (get_human_readable_count(total_parameters - trainable_parameters), "Non-trainable params"),
        (get_human_readable_count(total_parameters), "Total params"),
        (get_formatted_model_size(model_size), "Total estimated model params size (MB)"),
        (modes["train"], "Modules in train mode"),
        (modes["eval"], "Modules in eval mode"),
    ]
    return "\n".join([*rows, rule, *(f"{str(value):<10}{label}" for value, label in totals)])


def console_settings(trainer_config: Any, callbacks: list[L.Callback], terminal: bool | None = None) -> dict[str, Any]:
    """Trainer arguments: `callbacks` with StepProgressBar and ParameterSummary added where the trainer config
    leaves the progress bar or the model summary on and gives no callback of that kind (Lightning would add its
    own); none with `barebones`. `terminal` (default: whether standard output is one) false puts ProgressLines
    in the bar's place, with the bar off. With a summary callback in the list, `enable_model_summary` is passed
    as false: the callback prints the summary all the same, and the flag would only add Lightning's note that
    it skips its default one."""
    callbacks, settings = list(callbacks), {}
    if trainer_config.get("barebones"):  # Lightning refuses a progress bar or summary there
        return {"callbacks": callbacks}
    terminal = sys.stdout.isatty() if terminal is None else terminal
    bar_wanted = trainer_config.get("enable_progress_bar") is not False
    if bar_wanted and not any(isinstance(c, (ProgressBar, ProgressLines)) for c in callbacks):
        if not terminal:
            callbacks.append(ProgressLines())
            settings["enable_progress_bar"] = False
        elif importlib.util.find_spec("rich") is not None:
            callbacks.append(StepProgressBar())  # without rich, Lightning's tqdm bar stays
    if trainer_config.get("enable_model_summary") is not False and not any(isinstance(c, ModelSummary)
                                                                            for c in callbacks):
        callbacks.append(ParameterSummary())
    if any(isinstance(c, ModelSummary) for c in callbacks):
        settings["enable_model_summary"] = False
    return {"callbacks": callbacks, **settings}
