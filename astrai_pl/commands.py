"""`astrai-pl generate` and `astrai-pl chat`: the inference engine on a Hugging Face directory or a checkpoint.

    astrai-pl generate --model hf_dir/ --prompt "What is 2 + 3?"             (a user turn, through the chat template)
    astrai-pl generate --model hf_dir/ --prompt "Once upon a time" --no-chat-template --max-tokens 64
    astrai-pl generate --model last.ckpt --input prompts.jsonl --output completions.jsonl --temperature 0
    astrai-pl chat --model hf_dir/ --system "You answer in one sentence."
    astrai-pl chat --model base_hf_dir/ --adapter lora_adapter/

`--model` is a Hugging Face directory, a .ckpt written by `astrai-pl fit` (a LoRA run's holds its adapter) or a
sharded FSDP2 checkpoint folder; `--adapter DIR` puts a PEFT LoRA adapter directory on it. An adapter is merged
into the weights before serving (they stay fixed here, and merged they cost nothing per token). `--prompt` is a
user message through the tokenizer's chat template when it has one (`--no-chat-template`: plain text). Each
input line of `generate` is {"prompt": str} (plain text unless `--chat-template`) or {"messages": [...]}
(rendered with the chat template and its generation prompt); each output line keeps the input's fields and adds
"completion", "finish_reason" and "token_ids". `chat` keeps the conversation in an engine session, so each turn
computes only its own tokens, never the history again. Chat ids start with BOS exactly once (`bos_first`),
as every fine-tuning row does.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import jinja2
import torch

from .atomic import write_atomically
from .checkpoint import CheckpointError, is_sharded_checkpoint, load_transformer
from .checkpoint.archive import interrupted_copy
from .checkpoint.runs import resolve_latest
from .command_options import CHAT_HELP, chat_parser, generate_parser
from .command_options import add_model_arguments as _add_model_arguments  # noqa: F401  (serve, evaluate)
from .hub import resolve_model_option
from .inference import CapacityError, Engine, InferenceError, SamplingParams, SamplingParamsError, Session
from .jsonl import UTF8_FIX, NotUtf8, UnreadableJson, decode_utf8, parse_json
from .model import Transformer
from .model.adapter_files import is_adapter_dir, load_adapter
from .model.config import ConfigError
from .model.hf import export_dir
from .model.lora import merge_lora
from .tokenizer import Tokenizer, TokenizerError, load_tokenizer

CHUNK = 256  # prompts handed to the engine at once: it batches them; results are written as each chunk ends


class CommandError(ValueError):
    """A command-line input is unusable: a malformed prompt line, a tokenizer that does not fit the model."""


# -- model, tokenizer and sampling: shared by both verbs (their options: command_options.py) ----------
def generation_eos_ids(model_path: str | Path) -> list[int]:
    """End ids a Hugging Face directory's generation_config.json lists (often more than config.json's)."""
    path = Path(model_path) / "generation_config.json"
    if not path.is_file():
        return []
    try:
        ids = json.loads(path.read_bytes().decode("utf-8")).get("eos_token_id")
    except (ValueError, RecursionError, AttributeError) as err:  # bad JSON or UTF-8, too deep, not an object
        raise CommandError(f"{path} is not a JSON object ({err}); fix or delete the file") from None
    if ids is None:
        return []
    ids = ids if isinstance(ids, list) else [ids]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise CommandError(f"{path}: eos_token_id is {ids if len(ids) > 1 else ids[0]!r}; give a token id or a "
                           "list of token ids (numbers without quotes), or delete the key")
    return ids


def default_tokenizer(model_path: str | Path, adapter: str | Path | None = None) -> str:
    """The adapter directory when it holds tokenizer.json (a fine-tune that added tokens ships its own), else
    the model directory when it does, else the built-in byte tokenizer."""
    for path in (adapter, model_path):
        if path is not None and (Path(path) / "tokenizer.json").is_file():
            return str(path)
    return "byte"


def load_adapted(model_path: str | Path, adapter: str | Path | None, option: str = "--model") -> Transformer:
    """The model at `model_path` (HF directory or checkpoint) with the PEFT adapter directory `adapter` on it;
    a LoRA run's checkpoint comes with its own adapter. The adapter is kept apart (`model.lora_config`)."""
    model_path = resolve_latest(model_path)  # runs/x/latest/…: a pointer file names its run directory
    if is_adapter_dir(model_path):
        raise CommandError(f"{option} {model_path} is a PEFT adapter directory, not a model; pass its base model "
                           f"as {option} and this directory as --adapter")
    path = Path(model_path)  # or what a save cut off between two renames left beside it (loaded as usual)
    if not path.exists() and interrupted_copy(path) is None and not export_dir(path).exists():
        raise CommandError(f"{option} {model_path}: no such file or directory; pass a Hugging Face model directory "
                           "or a .ckpt written by astrai-pl fit")
    model = load_transformer(None, model_path)
    if adapter is not None:
        if model.lora_config is not None:
            raise CommandError(f"{option} {model_path} already holds a LoRA adapter (a LoRA run's checkpoint); "
                               f"leave --adapter out, or pass the base model as {option}")
        load_adapter(model, adapter)
        extra = model.__dict__["adapter_extra"]  # what adapter_config.json says besides; written back on save
        extra["base_model_name_or_path"] = extra.get("base_model_name_or_path") or str(model_path)
    return model


def load_engine(ns: argparse.Namespace) -> tuple[Engine, Tokenizer, list[int]]:
    """The engine on `--model` (with `--adapter` merged in), its tokenizer, and the extra end ids of a Hugging
    Face directory. Served weights stay fixed, so an adapter is merged: the engine then multiplies by one
    weight per projection, as for any model, instead of adding B·A·x on every token."""
    resolve_model_option(ns)  # a hub id in --model becomes its snapshot's folder in the hub cache
    model = load_adapted(ns.model, ns.adapter)
    if model.lora_config is not None:
        merge_lora(model)
    model.eval()
    tokenizer = load_tokenizer(ns.tokenizer or default_tokenizer(ns.model, ns.adapter))
    if tokenizer.vocab_size > model.config.vocab_size:
        raise CommandError(
            f"the tokenizer has {tokenizer.vocab_size} ids but {ns.model} only {model.config.vocab_size}; "
            "pass the tokenizer the model was trained with (--tokenizer DIR)"
        )
    path = Path(ns.model)
    hf_dir = path.is_dir() and not is_sharded_checkpoint(path)
    device = ns.device or ("cuda" if torch.cuda.is_available() else "cpu")
    engine = Engine(model, tokenizer, device=device, dtype=getattr(torch, ns.dtype) if ns.dtype else None,
                    max_total_tokens=ns.max_total_tokens,
                    cuda_graphs=False if getattr(ns, "enforce_eager", False) else None,  # serve --enforce-eager
                    speculative=getattr(ns, "speculative_config", None))  # serve --speculative-config
    return engine, tokenizer, generation_eos_ids(path) if hf_dir else []


def sampling_params(ns: argparse.Namespace, stop_token_ids: list[int]) -> SamplingParams:
    return SamplingParams(
        max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k, min_p=ns.min_p,
        repetition_penalty=ns.repetition_penalty, seed=ns.seed, stop=ns.stop, stop_token_ids=stop_token_ids,
    )


def _fail(verb: str, err: Exception) -> SystemExit:
    return SystemExit(f"astrai-pl {verb}: {err}")


# Errors whose message already says what is wrong and how to fix it: the verbs print them, no traceback.
USER_ERRORS = (CommandError, CheckpointError, ConfigError, TokenizerError, SamplingParamsError, InferenceError,
               FileNotFoundError)


# -- generate ----------------------------------------------------------------------------------------------
def _check_messages(messages: Any) -> str | None:
    """Why `messages` is not a chat, or None."""
    if not isinstance(messages, list) or not messages:
        return "'messages' must be a non-empty list"
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or "content" not in message:
            return f"messages[{i}] must be an object with a 'role' string and a 'content'"
    return None


def chat_ids(tokenizer: Tokenizer, messages: list[dict[str, Any]]) -> list[int]:
    """`messages` through the chat template with its generation prompt, starting with BOS exactly once when
    the tokenizer has one: the ids a model fine-tuned here saw before each answer (see data/preprocess.py)."""
    return bos_first(tokenizer, tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def bos_first(tokenizer: Tokenizer, ids: list[int]) -> list[int]:
    """`ids` starting with the tokenizer's BOS exactly once (as every training row does), if it has one."""
    bos = tokenizer.bos_token_id
    return ids if bos is None or ids[:1] == [bos] else [bos, *ids]


def prompt_ids(row: Any, tokenizer: Tokenizer, chat_template: bool, add_special_tokens: bool) -> list[int]:
    """The token ids of one input row: {"prompt": str} or {"messages": [...]} (raises ValueError saying why)."""
    if not isinstance(row, dict) or ("prompt" in row) == ("messages" in row):
        raise ValueError('expected an object with either "prompt" (a string) or "messages" (a list)')
    if "messages" in row:
        if (why := _check_messages(row["messages"])) is not None:
            raise ValueError(why)
        return chat_ids(tokenizer, row["messages"])
    if not isinstance(row["prompt"], str):
        raise ValueError(f"'prompt' must be a string, got {type(row['prompt']).__name__}")
    if chat_template:
        return chat_ids(tokenizer, [{"role": "user", "content": row["prompt"]}])
    return tokenizer.encode(row["prompt"], add_special_tokens=add_special_tokens)


def read_prompts(path: str | Path, tokenizer: Tokenizer, chat_template: bool, add_special_tokens: bool,
                 max_context: int) -> list[tuple[dict[str, Any], list[int]]]:
    """Every non-blank line of a JSONL file with its prompt ids; a bad line raises CommandError naming it."""
    rows = []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            where = f"{path}:{number}"
            try:
                row = parse_json(decode_utf8(raw))
                ids = prompt_ids(row, tokenizer, chat_template, add_special_tokens)
            except NotUtf8 as err:
                raise CommandError(f"{where}: {err}. Fix: {UTF8_FIX}") from None
            except UnreadableJson as err:
                raise CommandError(f"{where}: not valid JSON ({err}); "
                                   'each line must be an object like {"prompt": "..."}') from None
            except (ValueError, jinja2.TemplateError) as err:
                raise CommandError(f"{where}: {err}") from None
            if not ids:
                raise CommandError(f"{where}: the prompt is empty; give it some text")
            if len(ids) >= max_context:
                raise CommandError(f"{where}: the prompt has {len(ids)} tokens, the context holds {max_context}; "
                                   "shorten it or raise --max-total-tokens")
            rows.append((row, ids))
    return rows


def _completion_lines(engine: Engine, rows, params: SamplingParams) -> Iterator[str]:
    for start in range(0, len(rows), CHUNK):
        chunk = rows[start:start + CHUNK]
        for (row, _), out in zip(chunk, engine.generate([ids for _, ids in chunk], params)):
            record = {**row, "completion": out.text, "finish_reason": out.finish_reason, "token_ids": out.token_ids}
            yield json.dumps(record, ensure_ascii=False) + "\n"


def write_completions(engine: Engine, rows, params: SamplingParams, output: str | None, stdout: IO[str]) -> None:
    """One JSONL line per row, to `output` (atomically: a temporary file renamed over it) or to stdout."""
    if output is None:
        for line in _completion_lines(engine, rows, params):
            stdout.write(line)
        return
    write_atomically(Path(output), lambda f: f.writelines(
        line.encode("utf-8") for line in _completion_lines(engine, rows, params)))


def templates_prompt(choice: bool | None, tokenizer: Tokenizer) -> bool:
    """Whether `--prompt` goes through the chat template: as `--[no-]chat-template` says, else when the
    tokenizer has a template. A chat-tuned model given its question as plain text only ends the turn."""
    return tokenizer.chat_template is not None if choice is None else choice


def generate_verb(argv: list[str], stdout: IO[str] | None = None) -> None:
    """`astrai-pl generate` on the words after the verb (verbs.py reads them before importing this module)."""
    run_generate(generate_parser().parse_args(argv), stdout)


def run_generate(ns: argparse.Namespace, stdout: IO[str] | None = None) -> None:
    """`astrai-pl generate` on its parsed options: complete one prompt (printed as it streams) or every line of a
    JSONL file."""
    stdout = stdout or sys.stdout
    try:
        engine, tokenizer, eos_ids = load_engine(ns)
        params = sampling_params(ns, eos_ids)
        if ns.input is not None:
            rows = read_prompts(ns.input, tokenizer, bool(ns.chat_template), ns.add_special_tokens,
                                engine.max_context)
            write_completions(engine, rows, params, ns.output, stdout)
            return
        templated = templates_prompt(ns.chat_template, tokenizer)
        if templated and ns.chat_template is None:
            print("astrai-pl generate: --prompt is a user message through the tokenizer's chat template "
                  "(--no-chat-template: plain text)", file=sys.stderr)
        try:
            ids = prompt_ids({"prompt": ns.prompt}, tokenizer, templated, ns.add_special_tokens)
        except jinja2.TemplateError as err:
            raise CommandError(f"--prompt: {err}") from None
        if not ids:
            raise CommandError("--prompt is empty; give it some text")
        if ns.output is not None:
            write_completions(engine, [({"prompt": ns.prompt}, ids)], params, ns.output, stdout)
            return
        for delta in engine.stream(ids, params):
            stdout.write(delta.text)
            stdout.flush()
        stdout.write("\n")
    except USER_ERRORS as err:
        raise _fail("generate", err) from None


# -- chat --------------------------------------------------------------------------------------------------
class Conversation:
    """A chat whose K/V stay in an engine session between turns.

    Each turn renders the whole conversation with the chat template; when the session already holds a
    prefix of those ids (the usual case: the history and the reply just generated), only the rest is
    computed. When it does not — a reply that stopped on another end id, or whose text re-encodes to
    other ids — the session starts over on the templated conversation, whose full pages the prefix cache
    still mostly holds. Either way a turn sees exactly the ids the chat template gives.
    """

    def __init__(self, engine: Engine, tokenizer: Tokenizer, params: SamplingParams, system: str | None = None):
        if tokenizer.chat_template is None:
            raise CommandError("chat needs a tokenizer with a chat template; pass --tokenizer DIR with one "
                               "(tokenizer_config.json 'chat_template' or chat_template.jinja)")
        self.engine, self.tokenizer, self.params, self.system = engine, tokenizer, params, system
        self.session: Session | None = None
        opening = [{"role": "system", "content": system}] if system else []
        chat_ids(tokenizer, [*opening, {"role": "user", "content": "hi"}])  # a broken template fails here
        self.messages: list[dict[str, str]] = []
        self.reset()

    def reset(self) -> None:
        """Forget every turn (the system prompt stays) and release the session's pages."""
        self.close()
        self.session = self.engine.session()
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def reply(self, text: str) -> Iterator[str]:
        """Stream the answer to the user's `text`; the turn joins the conversation once the answer ends."""
        turn = [*self.messages, {"role": "user", "content": text}]
        ids = chat_ids(self.tokenizer, turn)
        held = self.session.tokens
        if ids[:len(held)] != held:
            self.session.close()
            self.session, held = self.engine.session(), []
        deltas = self.session.stream(ids[len(held):], self.params)
        completion = None
        try:
            for delta in deltas:
                if delta.text:
                    yield delta.text
                completion = delta.completion or completion
        finally:
            deltas.close()  # an abandoned answer is aborted; the turn is not kept
        assert completion is not None, "a finished stream ends with its completion"
        self.messages = [*turn, {"role": "assistant", "content": completion.text}]

    def close(self) -> None:
        if self.session is not None:
            self.session.close()


def _chat_loop(conversation: Conversation, stdin: IO[str], stdout: IO[str], interactive: bool) -> None:
    while True:
        if interactive:
            stdout.write("> ")
            stdout.flush()
        line = stdin.readline()
        command = line.strip()
        if not line or command == "/exit":
            if interactive and not line:  # Ctrl-D: the shell's prompt on a line of its own
                stdout.write("\n")
            return
        if command == "/reset":
            conversation.reset()
            if interactive:
                stdout.write("(new conversation)\n")
            continue
        if not command:
            continue
        pieces = conversation.reply(line.rstrip("\r\n"))
        try:
            for piece in pieces:
                stdout.write(piece)
                stdout.flush()
        except CapacityError as err:
            stdout.write(f"[{err}; /reset starts a new conversation]")
        except KeyboardInterrupt:
            stdout.write(" [interrupted]")
        finally:
            pieces.close()
        stdout.write("\n")
        stdout.flush()


def chat_verb(argv: list[str], stdin: IO[str] | None = None, stdout: IO[str] | None = None) -> None:
    """`astrai-pl chat` on the words after the verb (verbs.py reads them before importing this module)."""
    run_chat(chat_parser().parse_args(argv), stdin, stdout)


def run_chat(ns: argparse.Namespace, stdin: IO[str] | None = None, stdout: IO[str] | None = None) -> None:
    """`astrai-pl chat` on its parsed options: talk to a model turn by turn; each user line gets a streamed
    answer."""
    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    try:
        engine, tokenizer, eos_ids = load_engine(ns)
        conversation = Conversation(engine, tokenizer, sampling_params(ns, eos_ids), ns.system)
    except USER_ERRORS as err:
        raise _fail("chat", err) from None
    interactive = stdin.isatty()
    if interactive:
        stdout.write(f"chatting with {ns.model}; {CHAT_HELP}\n")
    try:
        _chat_loop(conversation, stdin, stdout, interactive)
    except KeyboardInterrupt:
        stdout.write("\n")
    except USER_ERRORS as err:
        raise _fail("chat", err) from None
    finally:
        conversation.close()
