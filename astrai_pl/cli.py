"""`astrai-pl`: LightningCLI for fit/validate/test, plus the project's own verbs.

    astrai-pl fit --config configs/pretrain/tiny.yaml [--trainer.max_steps 100 …]
    astrai-pl tokenizer train --input corpus.txt --vocab-size 8000 --output tok/
    astrai-pl convert --ckpt last.ckpt --output hf_dir/                  (a LoRA run's: its PEFT adapter directory)
    astrai-pl convert --ckpt last.ckpt --merge-lora --output hf_dir/     (the adapter folded in: a plain HF model)
    astrai-pl convert --ckpt base_hf_dir/ --adapter adapter_dir/ --merge-lora --output merged_dir/
    astrai-pl generate --model hf_dir/ --prompt "What is 2 + 3?"      (or --input prompts.jsonl --output out.jsonl)
    astrai-pl chat --model hf_dir/
    astrai-pl serve --model hf_dir/ [--port 8000] [--api-key KEY]    (OpenAI-compatible HTTP: /v1/completions, …)
    astrai-pl evaluate --model hf_dir/ --tasks astrai_arithmetic,astrai_next_sentence --output results.json
    astrai-pl sweep configs/sweeps/sft-debug.yaml [--count N] [--dry-run]   (a W&B sweep, without a W&B server)

Every config has a `wandb:` section; `--wandb.enabled true` logs the run to Weights & Biases (docs/tracking.md).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from jsonargparse import set_parsing_settings
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback

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
from .commands import USER_ERRORS, CommandError, chat_verb, generate_verb, load_adapted
from .data.rows import DataError
from .model.config import ConfigError
from .model.lora import merge_lora
from .objectives import Objective
from .objectives.options import renamed_in_parse_error
from .sweep import sweep_verb
from .tokenizer import load_tokenizer
from .warning_filters import install as install_warning_filters

LIGHTNING_VERBS = {"fit", "validate", "test", "predict"}

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


class AstraiCLI(LightningCLI):
    """LightningCLI whose model is any Objective and whose data is any LightningDataModule of ours, with one
    `wandb:` section (WandbConfig) whose `enabled` switches Weights & Biases logging on."""

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
        return super().instantiate_trainer(**kwargs)

    def before_instantiate_classes(self) -> None:
        """Each run in a directory of its own, `default_root_dir/version_N`, for what the config leaves unplaced
        (callbacks/resume.py place_outputs; which version a resumed run takes: checkpoint/runs.py)."""
        ckpt_path = self._get(self.config, "ckpt_path") if self.subcommand else None
        self.run_dir = place_outputs(self._get(self.config, "trainer"), self.subcommand, ckpt_path)

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
            parser_class=Parser,
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


# -- our own verbs -----------------------------------------------------------------------------------------
def _tokenizer_verb(argv: list[str]) -> None:
    from .tokenizer import train_bpe

    parser = argparse.ArgumentParser(prog="astrai-pl tokenizer", description="Train a byte-level BPE tokenizer.")
    sub = parser.add_subparsers(dest="action", required=True)
    train = sub.add_parser("train", help="train on text files (one document per line for .txt; 'text' column otherwise)")
    train.add_argument("--input", nargs="+", help="txt/json/jsonl/parquet files; default: the embedded corpus")
    train.add_argument("--vocab-size", type=int, required=True)
    train.add_argument("--min-frequency", type=int, default=2)
    train.add_argument("--text-field", default="text")
    train.add_argument("--output", required=True, help="directory to write tokenizer.json and its config into")
    ns = parser.parse_args(argv)
    tokenizer = train_bpe(_iter_texts(ns.input, ns.text_field), ns.vocab_size, min_frequency=ns.min_frequency)
    tokenizer.save_pretrained(ns.output)
    print(f"wrote a {tokenizer.vocab_size}-token tokenizer to {ns.output}")


def _iter_texts(paths: list[str] | None, text_field: str):
    from .data.corpus import embedded_documents
    from .data.pretrain import load_documents

    if not paths:
        yield from (d["text"] for d in embedded_documents())
        return
    for path in paths:
        yield from load_documents(path, text_field)[text_field]


def _convert_verb(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="astrai-pl convert",
        description="Export one of our checkpoints as a Hugging Face directory; a model with a LoRA adapter as a "
                    "PEFT adapter directory, or with --merge-lora as a Hugging Face directory with the adapter "
                    "folded into its weights.")
    parser.add_argument("--ckpt", required=True, help="a .ckpt written by astrai-pl fit, or a Hugging Face dir")
    parser.add_argument("--output", required=True)
    parser.add_argument("--tokenizer", default=None, help="'byte' or a tokenizer directory to write alongside")
    parser.add_argument("--adapter", default=None,
                        help="a PEFT LoRA adapter directory (written here or by PEFT) to put on --ckpt")
    parser.add_argument("--merge-lora", action="store_true",
                        help="fold the adapter into the weights (W + scale·B·A, as PEFT's merge_and_unload) and "
                             "write a plain Hugging Face model directory instead of the adapter")
    ns = parser.parse_args(argv)
    try:
        model = load_adapted(ns.ckpt, ns.adapter, option="--ckpt")
        if ns.merge_lora and model.lora_config is None:
            raise CommandError(f"--merge-lora: {ns.ckpt} holds no LoRA adapter; pass one with --adapter DIR, or "
                               "leave --merge-lora out")
        if ns.merge_lora:
            merge_lora(model)
        adapter_only = model.lora_config is not None
        model.save_pretrained(ns.output, tokenizer=load_tokenizer(ns.tokenizer) if ns.tokenizer else None)
    except USER_ERRORS as err:  # the message names the file and the fix
        raise SystemExit(f"astrai-pl convert: {err}") from None
    print(f"wrote {ns.output} ({'a PEFT adapter directory' if adapter_only else 'a Hugging Face model directory'})")


def _serve_verb(argv: list[str]) -> None:
    from .serve.cli import serve_verb  # FastAPI and uvicorn load only for this verb (the `serve` extra)

    serve_verb(argv)


def _evaluate_verb(argv: list[str]) -> None:
    from .evaluation.run import evaluate_verb  # lm-eval loads only for this verb (the `eval` extra)

    evaluate_verb(argv)


VERBS = {"tokenizer": _tokenizer_verb, "convert": _convert_verb, "generate": generate_verb, "chat": chat_verb,
         "sweep": sweep_verb, "serve": _serve_verb, "evaluate": _evaluate_verb}


def main(argv: list[str] | None = None) -> None:
    words = sys.argv[1:] if argv is None else argv
    if words and words[0] in VERBS:
        VERBS[words[0]](words[1:])
        return
    if words and not words[0].startswith("-") and words[0] not in LIGHTNING_VERBS:
        raise SystemExit(f"astrai-pl: unknown command {words[0]!r}; use one of "
                         f"{', '.join(sorted(LIGHTNING_VERBS | set(VERBS)))}")
    try:
        lightning_main(argv)  # None: LightningCLI reads sys.argv itself
    except (DataError, CheckpointError, ConfigError, NonFiniteLossError) as err:  # the message names the file or step and the fix
        raise SystemExit(f"astrai-pl: {err}") from None

if __name__ == "__main__":
    main()
