"""`astrai-pl`: the table of verbs, the top-level help, and dispatch to the module of each verb.

    astrai-pl --help                         every verb with one line on what it does
    astrai-pl VERB --help                    the options of one verb

The table names each verb's module instead of importing it: a verb's own libraries (Lightning and
jsonargparse for fit/validate/test, torch for the engine, FastAPI for serve (the `serve` extra), lm-eval
for evaluate (the `eval` extra)) load only when that verb runs, so `astrai-pl --help` imports none of them and `generate` no training stack;
`generate` and `chat` read their options (command_options.py) before importing torch, so their `--help` is immediate.
`tokenizer` and `convert`, two small verbs, live here, and the start of `generate` and `chat`. docs/cli.md describes every verb.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import sys
from pathlib import Path
from typing import Any, NamedTuple


class Verb(NamedTuple):
    target: str  # "module:function" under astrai_pl, called with the words after the verb (TRAIN: all words)
    summary: str
    group: str


TRAIN, USE, TOOLS = "train from a config (LightningCLI)", "use a model", "tools"
VERBS = {
    "fit": Verb("cli:lightning_verb", "train an objective (pretrain, SFT, DPO, GRPO, …): fit --config FILE", TRAIN),
    "validate": Verb("cli:lightning_verb", "the validation loop of a config's objective and data (--ckpt_path)",
                     TRAIN),
    "test": Verb("cli:lightning_verb", "the test loop of a config's objective and data (--ckpt_path)", TRAIN),
    "generate": Verb("verbs:generate_verb", "complete a prompt, or every line of a JSONL file into a JSONL file",
                     USE),
    "chat": Verb("verbs:chat_verb", "talk to a model turn by turn, answers streamed", USE),
    "serve": Verb("serve.cli:serve_verb", "an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, …)",
                  USE),
    "evaluate": Verb("evaluation.run:evaluate_verb", "lm-eval tasks on a model, results written as JSON", USE),
    "convert": Verb("verbs:convert_verb", "a checkpoint as a Hugging Face directory or PEFT adapter (--merge-lora)",
                    USE),
    "tokenizer": Verb("verbs:tokenizer_verb", "train a byte-level BPE tokenizer: tokenizer train --vocab-size N",
                      TOOLS),
    "sweep": Verb("sweep:sweep_verb", "run a W&B sweep file over configs, without a W&B server", TOOLS),
}

# Lightning's own `predict` loop is not a verb here: the engine completes prompts (`generate --input`).
REMOVED = {
    "predict": "astrai-pl has no predict: to complete a file of prompts with a trained model, run\n"
               "  astrai-pl generate --model CHECKPOINT_OR_HF_DIR --input prompts.jsonl --output completions.jsonl\n"
               '(one {"prompt": …} or {"messages": […]} per line in; each line with its "completion" out, written '
               "atomically); see astrai-pl generate --help",
}

EXAMPLES = """examples:
  astrai-pl fit --config configs/sft/tiny.yaml --trainer.max_steps 100
  astrai-pl fit --config configs/sft/tiny.yaml --print_config=comments   (every option, documented)
  astrai-pl convert --ckpt runs/sft-tiny/latest/checkpoints/last.ckpt --output my-model/
  astrai-pl generate --model my-model/ --prompt "What is 2 + 3?"
  astrai-pl chat --model my-model/

`astrai-pl VERB --help` lists a verb's options; docs/cli.md describes every verb."""


def top_level_help() -> str:
    """Usage, every verb with its one line (grouped), and a few examples."""
    lines = ["usage: astrai-pl VERB [options]", ""]
    width = max(map(len, VERBS)) + 2
    for group in (TRAIN, USE, TOOLS):
        lines.append(f"{group}:")
        lines += [f"  {name:<{width}}{verb.summary}" for name, verb in VERBS.items() if verb.group == group]
        lines.append("")
    return "\n".join(lines) + EXAMPLES + "\n"


def unknown_verb(word: str) -> str:
    close = difflib.get_close_matches(word, VERBS, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"astrai-pl: unknown command {word!r}{hint}; use one of {', '.join(VERBS)}; astrai-pl --help says more"


def main(argv: list[str] | None = None) -> None:
    """Run the verb `argv[0]` (None: the command line) on the words after it."""
    words = sys.argv[1:] if argv is None else argv
    if not words or words[0] in ("-h", "--help", "help"):
        sys.stdout.write(top_level_help())
        raise SystemExit(0 if words else 2)
    if words[0] in REMOVED:
        raise SystemExit(REMOVED[words[0]])
    # a first word starting with "-" is one of LightningCLI's top-level options, e.g. `--config FILE fit`
    verb = VERBS.get("fit" if words[0].startswith("-") else words[0])
    if verb is None:
        raise SystemExit(unknown_verb(words[0]))
    module, function = verb.target.split(":")
    from .warning_filters import install

    install()  # before the verb's libraries print what says nothing about the run (warning_filters.py)
    run = getattr(importlib.import_module(f"astrai_pl.{module}"), function)
    run(argv) if verb.group == TRAIN else run(words[1:])  # LightningCLI reads the verb itself


# -- the small verbs ---------------------------------------------------------------------------------------
def tokenizer_verb(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="astrai-pl tokenizer", description="Train a byte-level BPE tokenizer.")
    sub = parser.add_subparsers(dest="action", required=True)
    train = sub.add_parser("train", help="train on text files (one document per line for .txt; 'text' column otherwise)")
    train.add_argument("--input", nargs="+", help="txt/json/jsonl/parquet files; default: the embedded corpus")
    train.add_argument("--vocab-size", type=int, required=True)
    train.add_argument("--min-frequency", type=int, default=2)
    train.add_argument("--text-field", default="text")
    train.add_argument("--output", required=True, help="directory to write tokenizer.json and its config into")
    ns = parser.parse_args(argv)
    from .tokenizer import train_bpe

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


def generate_verb(argv: list[str]) -> None:
    """`astrai-pl generate`: its options read (`--help` answered) before torch and the engine load."""
    from .command_options import generate_parser

    ns = generate_parser().parse_args(argv)
    from .commands import run_generate

    run_generate(ns)


def chat_verb(argv: list[str]) -> None:
    """`astrai-pl chat`: its options read (`--help` answered) before torch and the engine load."""
    from .command_options import chat_parser

    ns = chat_parser().parse_args(argv)
    from .commands import run_chat

    run_chat(ns)


def convert_verb(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="astrai-pl convert",
        description="Export one of our checkpoints as a Hugging Face directory; a model with a LoRA adapter as a "
                    "PEFT adapter directory, or with --merge-lora as a Hugging Face directory with the adapter "
                    "folded into its weights.")
    parser.add_argument("--ckpt", required=True,
                        help="a .ckpt written by astrai-pl fit, a Hugging Face dir, or a hub id (owner/name)")
    parser.add_argument("--revision", default=None, help="branch, tag or commit of a hub id in --ckpt")
    parser.add_argument("--output", required=True,
                        help="the folder to write; in an existing one, files it does not write are kept")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace files of --output that this export writes (config.json, weights, tokenizer) "
                             "even though no export wrote them")
    parser.add_argument("--tokenizer", default=None,
                        help="'byte' or a tokenizer directory to write alongside. Default: the tokenizer the run "
                             "trained with, as its checkpoint records it (none for a Hugging Face --ckpt)")
    parser.add_argument("--adapter", default=None,
                        help="a PEFT LoRA adapter directory (written here or by PEFT) to put on --ckpt")
    parser.add_argument("--merge-lora", action="store_true",
                        help="fold the adapter into the weights (W + scale·B·A, as PEFT's merge_and_unload) and "
                             "write a plain Hugging Face model directory instead of the adapter")
    ns = parser.parse_args(argv)
    from .checkpoint.lora_base import peft_base
    from .commands import USER_ERRORS, CommandError, load_adapted
    from .hub import resolve_model_option
    from .model.lora import merge_lora

    try:
        resolve_model_option(ns, "ckpt")
        model = load_adapted(ns.ckpt, ns.adapter, option="--ckpt")
        if ns.merge_lora and model.lora_config is None:
            raise CommandError(f"--merge-lora: {ns.ckpt} holds no LoRA adapter; pass one with --adapter DIR, or "
                               "leave --merge-lora out")
        if ns.merge_lora:
            merge_lora(model)
        adapter_only = model.lora_config is not None
        tokenizer, spec = _export_tokenizer(ns.ckpt, ns.tokenizer)
        base = peft_base(model, Path(ns.output) / "base", tokenizer, ns.overwrite) if adapter_only else None
        model.save_pretrained(ns.output, tokenizer=tokenizer, overwrite=ns.overwrite)
    except (*USER_ERRORS, FileExistsError) as err:  # the message names the file and the fix
        raise SystemExit(f"astrai-pl convert: {err}") from None
    kind = f"a PEFT adapter directory on {base}" if adapter_only else "a Hugging Face model directory"
    print(f"wrote {ns.output} ({kind}{f'; tokenizer: {spec}' if spec else ', no tokenizer'})")


def _export_tokenizer(ckpt: str, given: str | None) -> tuple[Any, str | None]:
    """The tokenizer `convert` writes and how it was chosen: `--tokenizer`, else the one the run's checkpoint
    records (a recorded directory that is gone is an error naming it, not a model without its tokenizer)."""
    from .checkpoint.loading import recorded_tokenizer
    from .commands import CommandError
    from .tokenizer import load_tokenizer

    if given:
        return load_tokenizer(given), given
    recorded = recorded_tokenizer(ckpt)
    if recorded is None:
        return None, None
    if recorded != "byte" and not Path(recorded).is_dir():
        raise CommandError(f"{ckpt} was trained with the tokenizer {recorded!r}, which is not a folder from here; "
                           "pass it with --tokenizer DIR (or --tokenizer byte)")
    return load_tokenizer(recorded), f"{recorded} (the run's, as its checkpoint records it)"


if __name__ == "__main__":
    main()
