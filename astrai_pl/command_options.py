"""The options of `astrai-pl generate` and `astrai-pl chat`, apart from the engine and importing nothing of ours:
the verbs (verbs.py) read them, and answer `--help`, before torch and the model code are imported, which takes
seconds; commands.py runs them. `serve` and `evaluate` share the model options."""

from __future__ import annotations

import argparse

DTYPES = ("float32", "bfloat16", "float16")  # --dtype: names of torch dtypes
# SamplingParams' defaults (inference/sampling.py imports torch); tests/test_cli_verbs.py checks they agree.
SAMPLING_DEFAULTS = {"max_tokens": 256, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
                     "repetition_penalty": 1.0}
CHAT_HELP = "/reset starts a new conversation, /exit (or Ctrl-D) quits"


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model")
    group.add_argument("--model", required=True,
                       help="a Hugging Face directory, a .ckpt written by astrai-pl fit, a sharded checkpoint folder, "
                            "or a hub id (owner/name, hf://owner/name; an existing local path wins)")
    group.add_argument("--revision", default=None, help="branch, tag or commit of a hub id in --model")
    group.add_argument("--adapter", default=None,
                       help="a PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors, written "
                            "here or by PEFT) for the base --model; merged into its weights before serving")
    group.add_argument("--tokenizer", default=None,
                       help="'byte' or a tokenizer directory (default: the adapter's, else the model directory's, "
                            "else 'byte')")
    group.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    group.add_argument("--dtype", choices=DTYPES, default=None, help="default: as loaded (float32)")
    group.add_argument("--max-total-tokens", type=int, default=None,
                       help="KV pool size in tokens (default: 80%% of free GPU memory, 32k on CPU)")


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling (see SamplingParams)")
    defaults = SAMPLING_DEFAULTS
    group.add_argument("--max-tokens", type=int, default=defaults["max_tokens"])
    group.add_argument("--temperature", type=float, default=defaults["temperature"], help="0 is greedy")
    group.add_argument("--top-p", type=float, default=defaults["top_p"])
    group.add_argument("--top-k", type=int, default=defaults["top_k"], help="0 keeps every token")
    group.add_argument("--min-p", type=float, default=defaults["min_p"])
    group.add_argument("--repetition-penalty", type=float, default=defaults["repetition_penalty"])
    group.add_argument("--seed", type=int, default=None)
    group.add_argument("--stop", action="append", default=[], help="a stop string; repeat for several")


def generate_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="astrai-pl generate", description="Complete one prompt, or every line of a JSONL file of prompts.")
    add_model_arguments(parser)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="one prompt; its completion is printed as it is generated")
    source.add_argument("--input", help='a JSONL file: one {"prompt": str} or {"messages": [...]} per line')
    parser.add_argument("--output", help="write JSONL completions here (default: stdout)")
    parser.add_argument("--chat-template", action=argparse.BooleanOptionalAction, default=None,
                        help="render a plain prompt as one user message through the tokenizer's chat template. "
                             "Default: --prompt is, when the tokenizer has a template (as a chat endpoint); "
                             '{"prompt"} lines of --input stay plain text (as a completions endpoint); '
                             '{"messages"} lines are always templated')
    parser.add_argument("--add-special-tokens", action="store_true",
                        help="let the tokenizer add its specials (e.g. BOS) to plain prompts")
    add_sampling_arguments(parser)
    return parser


def chat_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="astrai-pl chat", description="Talk to a model turn by turn; answers stream as they are generated.",
        epilog=CHAT_HELP)
    add_model_arguments(parser)
    parser.add_argument("--system", default=None, help="a system prompt opening every conversation")
    add_sampling_arguments(parser)
    return parser

