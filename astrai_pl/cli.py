"""`astrai-pl fit|validate|test`: LightningCLI over our objectives and data modules.

    astrai-pl fit --config configs/pretrain/tiny.yaml [--trainer.max_steps 100 …]
    astrai-pl fit --config configs/sft/tiny.yaml --print_config=comments    (every option, with its documentation)
    astrai-pl validate --config configs/sft/tiny.yaml --ckpt_path runs/sft-tiny/latest/checkpoints/last.ckpt

`astrai-pl` itself (the table of verbs, the top-level help, the other verbs) is verbs.py; this module, with
Lightning and jsonargparse, loads only for these three verbs. Lightning's `predict` is left out (`generate
--input` completes a file of prompts), and so are LightningCLI's `--optimizer`/`--lr_scheduler`, which
would replace the objective's own optimizer and schedule: they are refused, naming the fields to set.
Every config has a `wandb:` section; `--wandb.enabled true` logs the run to Weights & Biases (docs/tracking.md).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import yaml
from jsonargparse import set_parsing_settings
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback

from .callbacks.console import console_settings
from .callbacks.metrics import NonFiniteLossError
from .callbacks.resume import place_outputs
from .callbacks.safety import SafetyConfig, as_list, safety_callbacks, safety_plugins
from .callbacks.tracking import (
    WandbConfig,
    log_config,
    tracking_callbacks,
    wandb_logger,
    wandb_loggers,
    with_wandb,
)
from .checkpoint import CheckpointError
from .checkpoint.archive import checkpoint_error_in, prepare_resume_from_last, verify_archive
from .checkpoint.runs import RUN_DIR_ENV, resolve_latest
from .data.rows import DataError
from .model.config import ConfigError
from .objectives import Objective
from .objectives.options import renamed_in_parse_error
from .verbs import main  # `python -m astrai_pl.cli` and callers of `astrai_pl.cli.main`
from .warning_filters import install as install_warning_filters
from .warning_filters import keep_run_dir_quiet

# Field docstrings (`"""..."""` under each dataclass attribute) become --help text and
# `--print_config=comments` comments.
set_parsing_settings(docstring_parse_attribute_docstrings=True)
install_warning_filters()  # third-party messages that say nothing about the run (warning_filters.py)


class SaveConfig(SaveConfigCallback):
    """Lightning's config.yaml in the log directory, and the same resolved config in every W&B run."""

    def save_config(self, trainer, pl_module, stage: str) -> None:
        if wandb_loggers(trainer):
            log_config(trainer, self.parser.dump(self.config, skip_none=False))


class Parser(LightningArgumentParser):
    """A config naming an option that took a new name is refused with the new name, not only "not accepted"."""

    def error(self, message: str, ex: Exception | None = None):
        renamed = renamed_in_parse_error(message) if self.exit_on_error else None
        if renamed is not None:
            raise ConfigError(renamed)
        super().error(message, ex)


# LightningCLI's own optimizer options and the objective's fields that say the same, with an example of each.
OBJECTIVE_OPTIMIZATION = {
    "optimizer": ("model.init_args.optimizer", "torch.optim.AdamW", "lr 1e-4"),
    "lr_scheduler": ("model.init_args.scheduler", "astrai_pl.objectives.schedules.WarmupCosine", "warmup_steps 100"),
}


def refuse_lightning_optimizers(args: Any) -> None:
    """ConfigError for LightningCLI's `--optimizer`/`--lr_scheduler`, given as options or as keys of a config
    file: they would replace the objective's configure_optimizers, so its parameter groups (no weight decay
    on norms and biases) and its schedule fitted to the run's length would be silently lost."""
    args = args.as_dict() if hasattr(args, "as_dict") else args  # a jsonargparse Namespace
    names = _section_keys(args) if isinstance(args, dict) else [*_option_names(args), *_config_keys(args)]
    for name in names:
        if name in OBJECTIVE_OPTIMIZATION:
            field, example, init_arg = OBJECTIVE_OPTIMIZATION[name]
            raise ConfigError(
                f"--{name} (LightningCLI's) would replace the objective's own optimizer and schedule, so astrai-pl "
                f"refuses it; set the objective's field {field} instead, in the config or as "
                f"--{field} {example} --{field}.init_args.{init_arg}")


def _option_names(args: list[str]) -> list[str]:
    """The section of each `--section.key value` / `--section=value` option."""
    return [word[2:].split("=")[0].split(".")[0] for word in args if word.startswith("--")]


def _config_keys(args: list[str]) -> list[str]:
    """Top-level keys of the config files in `args` (and of their fit/validate/test sections); a file that
    cannot be read is left to jsonargparse, which names it."""
    keys = []
    for i, word in enumerate(args):
        path = word.split("=", 1)[1] if word.startswith("--config=") else None
        if word in ("-c", "--config") and i + 1 < len(args):
            path = args[i + 1]
        try:
            config = yaml.safe_load(Path(path).read_text(encoding="utf-8")) if path else None
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            continue
        keys += _section_keys(config)
    return keys


def _section_keys(config: Any) -> list[str]:
    """The keys of a config (a dict), and of its fit/validate/test sections."""
    if not isinstance(config, dict):
        return []
    sections = [config, *(config[v] for v in ("fit", "validate", "test") if isinstance(config.get(v), dict))]
    return [str(key) for section in sections for key in section]


def subcommand_help(verb: str) -> dict[str, str]:
    """What `astrai-pl VERB --help` opens with: one usage line (not one per option) and where the options are
    shown best."""
    return {
        "usage": f"astrai-pl {verb} --config FILE [--section.key VALUE …]   (astrai-pl --help: every verb)",
        "description": (
            "Every option below is a key of the config file (--trainer.max_steps 100 is trainer: max_steps: 100). "
            f"Shorter to read: astrai-pl {verb} --config FILE --print_config=comments prints the whole config "
            "this run would use, each field with its documentation; --model.help SFT and --data.help SFTData "
            "show one class's fields. Sections: trainer (Lightning's Trainer), model (the objective: arch, "
            "optimizer, scheduler, …), data (the data module), wandb, safety; then ckpt_path."),
    }


class AstraiCLI(LightningCLI):
    """LightningCLI whose model is any Objective and whose data is any LightningDataModule of ours, with one
    `wandb:` section (WandbConfig) whose `enabled` switches Weights & Biases logging on."""

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        """fit, validate and test; Lightning's predict needs a predict_step, and `generate` does that job."""
        return {verb: skip for verb, skip in LightningCLI.subcommands().items() if verb != "predict"}

    def parse_arguments(self, parser, args) -> None:
        refuse_lightning_optimizers(sys.argv[1:] if args is None else args)
        super().parse_arguments(parser, args)

    def add_arguments_to_parser(self, parser) -> None:
        # The tokenizer is declared once, on the data module; the objective receives the same object.
        parser.link_arguments("data.tokenizer", "model.init_args.tokenizer", apply_on="instantiate")
        parser.add_class_arguments(WandbConfig, "wandb")
        parser.add_class_arguments(SafetyConfig, "safety")

    def instantiate_trainer(self, **kwargs):
        trainer, safety = self._get(self.config_init, "trainer"), self._get(self.config_init, "safety")
        kwargs["callbacks"] = safety_callbacks(safety, as_list(trainer.get("callbacks")))
        kwargs["plugins"] = safety_plugins(safety, as_list(trainer.get("plugins")))
        settings = self._get(self.config_init, "wandb")
        if settings.enabled:
            root = self.run_dir or trainer.get("default_root_dir") or os.getcwd()
            kwargs["logger"] = with_wandb(trainer.get("logger"), wandb_logger(settings, root))
            kwargs["callbacks"] += tracking_callbacks(settings, root)
        kwargs.update(console_settings(trainer, kwargs["callbacks"]))  # the step-counted bar, a summary without FLOPs
        return super().instantiate_trainer(**kwargs)

    def before_instantiate_classes(self) -> None:
        """Each run in a directory of its own, `default_root_dir/version_N`, for what the config leaves unplaced
        (callbacks/resume.py place_outputs; which version a resumed run takes: checkpoint/runs.py)."""
        ckpt_path = self._get(self.config, "ckpt_path") if self.subcommand else None
        trainer = self._get(self.config, "trainer")
        placed_logger = trainer.get("logger") is True  # place_outputs makes it a CSVLogger in the run directory
        self.run_dir = place_outputs(trainer, self.subcommand, ckpt_path)
        if placed_logger and self.run_dir is not None:
            keep_run_dir_quiet(self.run_dir)

    def before_fit(self) -> None:
        """`--ckpt_path last`: put back what a cut-off checkpoint replace left; refuse a restart from step 0
        when the checkpoint folder holds checkpoints but no last one (checkpoint/archive.py)."""
        prepare_resume_from_last(self.trainer, self._get(self.config_init, "ckpt_path"))

    def _parse_ckpt_path(self) -> None:
        """The config alone says what is built. LightningCLI would merge the hyperparameters stored in an
        explicit `--ckpt_path FILE` into the config, so a file could choose classes and import paths (reward
        functions, optimizers) to import and call; here the file is only verified (complete archive, CRC-32
        of every member) and its weights are restored later by the trainer, as with `--ckpt_path last`."""
        subcommand = self.config.get("subcommand")
        path = subcommand and self.config[subcommand].get("ckpt_path")
        if path and path != "last":  # a `latest` pointer file in the path names its run directory
            path = self.config[subcommand].ckpt_path = resolve_latest(path)
        if path and Path(path).is_file():
            verify_archive(Path(path))


def lightning_main(args: list[str] | None = None, run: bool = True) -> AstraiCLI:
    """`astrai-pl fit|validate|test` on `args` (None: the command line); run=False builds the objective, the
    data module and the trainer and returns them unrun (`cli.trainer.fit(cli.model, datamodule=cli.datamodule)`)."""
    command_line, run_dir = sys.argv, os.environ.get(RUN_DIR_ENV)
    if args is not None:  # `args` replace the command line, such as a notebook kernel's own arguments
        sys.argv = command_line[:1]
    try:
        return AstraiCLI(
            model_class=Objective, datamodule_class=None, subclass_mode_model=True, subclass_mode_data=True,
            args=args, run=run, save_config_callback=SaveConfig, save_config_kwargs={"overwrite": True},
            parser_class=Parser, auto_configure_optimizers=False,
            parser_kwargs={verb: subcommand_help(verb) for verb in AstraiCLI.subcommands()},
        )
    except ValueError as err:
        cause = checkpoint_error_in(err)  # jsonargparse wraps an objective's CheckpointError in a config dump
        if cause is None or cause is err:
            raise
        raise cause from None
    finally:
        sys.argv = command_line
        if run_dir is None:  # the run's directory was chosen here: the next run in this process chooses anew
            os.environ.pop(RUN_DIR_ENV, None)


def lightning_verb(argv: list[str] | None = None) -> None:
    """`astrai-pl fit|validate|test …` (None: sys.argv); an error whose message names the fix ends it without a
    traceback."""
    try:
        lightning_main(argv)  # None: LightningCLI reads sys.argv itself
    except (DataError, CheckpointError, ConfigError, NonFiniteLossError) as err:
        raise SystemExit(f"astrai-pl: {err}") from None


if __name__ == "__main__":
    main()
