"""Tokenizer: a Hugging Face `tokenizers` backend plus jinja2 chat templates, a byte tokenizer and BPE training.

Files use the Hugging Face fast-tokenizer layout, so `transformers.AutoTokenizer` reads what `save_pretrained`
writes, and `apply_chat_template` gives the ids transformers gives on the same folder.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as Backend

from .atomic import write_atomically
from .hub import resolve_tokenizer

SPECIAL_TOKEN_KEYS = tuple(f"{name}_token" for name in ("bos", "eos", "unk", "sep", "pad", "cls", "mask"))
BYTE_SPECIALS = ("<pad>", "<bos>", "<eos>", "<|im_start|>", "<|im_end|>")
BYTE_RESERVED = tuple(f"<|reserved_{i}|>" for i in range(len(BYTE_SPECIALS), 8))
BYTE_OFFSET = len(BYTE_SPECIALS) + len(BYTE_RESERVED)  # id of byte 0 in the byte tokenizer
BYTE_SPECIAL_TOKENS = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")
UNBOUNDED_LENGTH = int(1e30)  # the model_max_length transformers writes when no limit is known
# ChatML; with `tools`, their schemas follow the system prompt, an assistant's `tool_calls` are written as
# <tool_call> JSON after its content, and consecutive `tool` results share one user turn (Qwen2.5's layout)
CHATML_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}{% endif %}"
    "{{ '# Tools\n\nThese functions may be called:\n<tools>' }}"
    "{% for tool in tools %}{{ '\n' + tool | tojson }}{% endfor %}"
    "{{ '\n</tools>\n\nCall one by writing {\"name\": <name>, \"arguments\": <arguments>} between "
    "<tool_call> and </tool_call>.<|im_end|>\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\n' }}{% endif %}"
    "{% elif message['tool_calls'] %}{{ '<|im_start|>assistant\n' }}"
    "{% if message['content'] %}{{ message['content'] + '\n' }}{% endif %}"
    "{% for call in message['tool_calls'] %}{% set f = call['function'] %}"
    "{% if not loop.first %}{{ '\n' }}{% endif %}"
    "{{ '<tool_call>\n{\"name\": \"' + f['name'] + '\", \"arguments\": ' }}"
    "{{ f['arguments'] if f['arguments'] is string else f['arguments'] | tojson }}{{ '}\n</tool_call>' }}"
    "{% endfor %}{{ '<|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_TURN_MARKER = "zq7Xturnmarker"  # assistant content that no template alters


class TokenizerError(ValueError):
    """A tokenizer file or argument is malformed or inconsistent."""


class ChatTemplateError(TokenizerError, jinja2.TemplateError):
    """The chat template failed to compile or to render (a syntax error, `raise_exception`, an unsafe access)."""

    def __init__(self, message: str):
        TokenizerError.__init__(self, message)


# --- chat templates -------------------------------------------------------------------------------


class _GenerationBlock(Extension):
    """Accepts `{% generation %}…{% endgeneration %}` (used to mark assistant spans) and renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


_TOJSON_OPTIONS = ("indent", "separators", "sort_keys")


def _tojson(value: Any, ensure_ascii: bool = False, **options: Any) -> str:
    """Plain json.dumps (indent, separators, sort_keys): jinja's own filter HTML-escapes characters. Other
    options (`cls=`, `default=`) would hand json.dumps a callable from the template: refused."""
    if unknown := sorted(set(options) - set(_TOJSON_OPTIONS)):
        raise jinja2.exceptions.TemplateError(f"tojson takes only {', '.join(_TOJSON_OPTIONS)} and ensure_ascii, "
                                              f"not {unknown[0]}")
    return json.dumps(value, ensure_ascii=ensure_ascii, **options)


@lru_cache(maxsize=16)
def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in the sandbox with the options and helpers Hub templates expect."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _template_message(message: dict[str, Any]) -> dict[str, Any]:
    """Drop None-valued keys and copy reasoning under the names templates read, as transformers does."""
    if not isinstance(message, dict):
        raise TypeError(f"chat messages must be dicts with 'role' and 'content', got {message!r}")
    message = {key: value for key, value in message.items() if value is not None}
    reasoning = next((message[key] for key in REASONING_FIELDS if key in message), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


# --- files ------------------------------------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as err:  # not JSON, not UTF-8, nested too deeply, an over-long integer
        raise TokenizerError(f"{path} is not valid JSON ({type(err).__name__}: {str(err)[:200]}); restore or "
                             "regenerate the file") from None
    if not isinstance(value, dict):
        raise TokenizerError(f"{path} holds a JSON {type(value).__name__}, not an object; restore or regenerate "
                             "the file")
    return value


def _read_backend(path: Path) -> Backend:
    try:
        return Backend.from_file(str(path))
    except Exception as err:  # `tokenizers` raises a bare Exception for any unreadable file
        raise TokenizerError(f"{path} is not a tokenizer file the `tokenizers` library can read ({err}); "
                             "restore it, or re-save the tokenizer with save_pretrained") from None


def _write_atomic(path: Path, text: str | dict[str, Any]) -> None:
    """Write text (or a dict as JSON) to `path` atomically (astrai_pl/atomic.py), readable by everyone."""
    if isinstance(text, dict):
        text = json.dumps(text, indent=2, ensure_ascii=False) + "\n"
    write_atomically(path, lambda f: f.write(text.encode("utf-8")), mode=0o644)


def _read_special_tokens(folder: Path, config: dict[str, Any]) -> dict[str, str]:
    """Named special tokens from tokenizer_config.json (else special_tokens_map.json); strings or AddedToken dicts."""
    found = {**_read_json(folder / "special_tokens_map.json"), **config}
    tokens = {key: found.get(key) for key in SPECIAL_TOKEN_KEYS}
    tokens = {key: tok["content"] if isinstance(tok, dict) else tok for key, tok in tokens.items() if tok}
    for key, tok in tokens.items():
        if not isinstance(tok, str):
            raise TokenizerError(f"{folder / 'tokenizer_config.json'}: {key} is {tok!r}; give the token's text "
                                 'as a string (e.g. "</s>") or an object with a "content" string')
    return tokens


def _read_chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    """chat_template.jinja (newer transformers) wins; else the config's one template or its 'default' entry."""
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8")
    value = config.get("chat_template")
    if value is None or isinstance(value, str):
        return value
    entries = value if isinstance(value, list) else [value]
    if not all(isinstance(e, dict) and isinstance(e.get("name"), str) and isinstance(e.get("template"), str)
               for e in entries):
        raise TokenizerError(
            f"{folder / 'tokenizer_config.json'}: chat_template is {str(value)[:80]!r}; give a jinja string or a "
            'list of {"name": ..., "template": ...} objects')
    named = {entry["name"]: entry["template"] for entry in entries}
    if "default" not in named:
        raise TokenizerError(
            f"{folder / 'tokenizer_config.json'}: chat_template lists {sorted(named)} but none is named "
            "'default'; rename the one to use to 'default' or set tokenizer.chat_template after loading"
        )
    return named["default"]


# --- byte-level pieces ----------------------------------------------------------------------------


def byte_symbols() -> list[str]:
    """The printable character ByteLevel uses for each byte 0..255, in byte order.

    Printable Latin-1 bytes stand for themselves; the others take code points 256, 257, … in byte order.
    """
    kept = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    shifted = iter(range(256, 512))
    return [chr(byte) if byte in kept else chr(next(shifted)) for byte in range(256)]


def _byte_level_pipeline(backend: Backend, specials: Sequence[str]) -> Backend:
    """Byte-level pre-tokenizer and decoder, `<bos>` prepended by add_special_tokens, specials registered."""
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    bos = ("<bos>", backend.token_to_id("<bos>"))
    backend.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B:1", special_tokens=[bos]
    )
    return backend


# --- the tokenizer ----------------------------------------------------------------------------------


class Tokenizer:
    """Text ↔ ids over a `tokenizers.Tokenizer`, with named special tokens and a jinja2 chat template."""

    def __init__(
        self,
        backend: Backend,
        special_tokens: dict[str, str] | None = None,
        chat_template: str | None = None,
        model_max_length: int = UNBOUNDED_LENGTH,
    ):
        self.backend = backend
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        if unknown := set(self.special_tokens) - set(SPECIAL_TOKEN_KEYS):
            raise TokenizerError(f"unknown special token keys {sorted(unknown)}; use {SPECIAL_TOKEN_KEYS}")
        missing = [t for t in self.special_tokens.values() if backend.token_to_id(t) is None]
        if missing:  # transformers appends named special tokens absent from the vocabulary; so do we
            backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing])
        self.chat_template = chat_template
        self._template_file: tuple[str, str | None] | None = None  # (file read from, template read), for errors
        self.model_max_length = model_max_length

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> Tokenizer:
        """Load tokenizer.json, tokenizer_config.json (+ special_tokens_map.json, chat_template.jinja)."""
        folder = Path(path)
        if not folder.is_dir():
            raise FileNotFoundError(
                f"tokenizer folder {folder} does not exist (or is a file); pass a folder written by save_pretrained "
                "or downloaded from the Hugging Face Hub (e.g. `huggingface-cli download <repo>`)"
            )
        if not (folder / "tokenizer.json").is_file():
            raise FileNotFoundError(
                f"{folder / 'tokenizer.json'} not found; only the fast-tokenizer format is read. Convert the "
                f"folder once with `transformers.AutoTokenizer.from_pretrained('{folder}').save_pretrained('{folder}')`"
            )
        # tokenizer.json's post-processor decides what add_special_tokens adds; like transformers 5,
        # add_bos_token/add_eos_token in tokenizer_config.json are ignored when tokenizer.json exists.
        backend = _read_backend(folder / "tokenizer.json")
        config = _read_json(folder / "tokenizer_config.json")
        max_length = config.get("model_max_length") or UNBOUNDED_LENGTH
        if not isinstance(max_length, (int, float)) or isinstance(max_length, bool) or not max_length >= 1:
            raise TokenizerError(f"{folder / 'tokenizer_config.json'}: model_max_length is {max_length!r}; give a "
                                 "positive number of tokens, or remove the key")
        max_length = int(min(max_length, UNBOUNDED_LENGTH))
        tokenizer = cls(
            backend, _read_special_tokens(folder, config), _read_chat_template(folder, config), max_length
        )
        jinja = folder / "chat_template.jinja"
        tokenizer._template_file = (str(jinja if jinja.is_file() else folder / "tokenizer_config.json"),
                                    tokenizer.chat_template)
        return tokenizer

    @classmethod
    def byte_level(cls) -> Tokenizer:
        """A 264-token byte tokenizer needing no files: 8 specials at ids 0..7, byte b at id 8 + b."""
        names = [*BYTE_SPECIALS, *BYTE_RESERVED, *byte_symbols()]
        bpe = models.BPE(vocab={name: i for i, name in enumerate(names)}, merges=[])
        backend = _byte_level_pipeline(Backend(bpe), [*BYTE_SPECIALS, *BYTE_RESERVED])
        return cls(backend, BYTE_SPECIAL_TOKENS, CHATML_TEMPLATE)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids of `text` (no added specials) and each token's (start, end) character span in it."""
        encoding = self.backend.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False) -> list[list[int]]:
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(int(token_id))

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    def _special_id(self, key: str) -> int | None:
        return self.backend.token_to_id(self.special_tokens[key]) if key in self.special_tokens else None

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._special_id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        """The pad token's id, or the eos id when the tokenizer names no pad token."""
        pad = self._special_id("pad_token")
        return self.eos_token_id if pad is None else pad

    @property
    def eos_token_ids(self) -> list[int]:
        """Ids that end a generation: eos, any end-of-turn special token this vocabulary has, and the special
        token the chat template writes right after an assistant message."""
        added = {token.content: i for i, token in self.backend.get_added_tokens_decoder().items()}
        ids = [self.eos_token_id, *(added[token] for token in END_OF_TURN_TOKENS if token in added),
               self.template_end_of_turn_id()]
        return list(dict.fromkeys(i for i in ids if i is not None))

    def template_end_of_turn_id(self) -> int | None:
        """The special token that follows an assistant message's content in the chat template, or None.

        Found by rendering a short conversation whose assistant content is a marker string; a template
        that cannot render it (e.g. one that demands a system message) has none that can be found.
        """
        if self.chat_template is None:
            return None
        turn = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _TURN_MARKER}]
        special = {i for i, token in self.backend.get_added_tokens_decoder().items() if token.special}
        for messages in ([*turn, turn[0]], turn):
            try:
                text = self.apply_chat_template(messages, tokenize=False)
            except (ChatTemplateError, TypeError, KeyError, IndexError):
                continue
            _, found, after = text.partition(_TURN_MARKER)
            ids = self.encode(after.lstrip()) if found else []
            if ids and ids[0] in special:
                return ids[0]
        return None

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        **kwargs: Any,
    ) -> list[int] | str:
        """Render `messages` with the chat template; ids (encoded without added specials) or the string.

        Keyword arguments reach the template as variables (`tools=[…]`, `enable_thinking=False`); like
        transformers, `tools` and `documents` are defined (None) when not given.
        """
        if self.chat_template is None:
            raise TokenizerError(
                "this tokenizer has no chat_template; set `tokenizer.chat_template = '…jinja…'` or add "
                "'chat_template' to tokenizer_config.json (or a chat_template.jinja file) in its folder"
            )
        if len(messages) == 0:
            raise TokenizerError("apply_chat_template got an empty conversation; pass at least one message")
        templated = [_template_message(m) for m in messages]
        try:
            text = compile_chat_template(self.chat_template).render(
                messages=templated,
                add_generation_prompt=add_generation_prompt,
                **{"tools": None, "documents": None, **self.special_tokens, **kwargs},
            )
        except Exception as err:  # noqa: BLE001 - a template error, or any exception a filter or test raised
            raise self._template_error(err) from None
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def _template_error(self, err: Exception) -> ChatTemplateError:
        """One line naming the template (its file when read from one) and what went wrong in it."""
        why = f"{type(err).__name__}: {str(err).rstrip('.')[:300]}"
        where = "tokenizer_config.json 'chat_template' or chat_template.jinja"  # set after loading, or built in
        if self._template_file is not None and self._template_file[1] == self.chat_template:
            file = self._template_file[0]
            where = file if file.endswith(".jinja") else f"{file} 'chat_template'"
        return ChatTemplateError(f"the chat template failed: {why}; fix the template ({where}): it runs sandboxed "
                                 "and may only format the messages")

    def _template_writes_bos(self) -> bool:
        """Whether the chat template's text starts with the BOS token (True when no probe conversation renders:
        such a template is left as it is)."""
        user = {"role": "user", "content": "hi"}
        for messages in ([user], [{"role": "system", "content": "hi"}, user]):
            try:
                text = self.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            except (ChatTemplateError, TypeError, KeyError, IndexError):
                continue
            return text.startswith(self.bos_token)
        return True

    def exported_chat_template(self) -> str | None:
        """The chat template a model export saves: led by `{{ bos_token }}` when the tokenizer has a BOS that the
        template does not write. Every row trained here starts with BOS (data/preprocess.py) and `generate` and
        `serve` put it before the templated ids (commands.bos_first), while transformers' and vLLM's
        apply_chat_template take the rendered text as the whole prompt; with the BOS in the template they give
        the model the ids it was trained on, and our own reading of the folder gives the same ids as before."""
        if self.chat_template is None or self.bos_token is None or self._template_writes_bos():
            return self.chat_template
        return "{{ bos_token }}" + self.chat_template

    def save_pretrained(self, path: str | os.PathLike, bos_in_template: bool = False) -> None:
        """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json that transformers loads;
        `bos_in_template` saves `exported_chat_template()` (what a model export writes) instead of the template."""
        folder = Path(path)
        folder.mkdir(parents=True, exist_ok=True)
        config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": self.model_max_length,
            "clean_up_tokenization_spaces": False,
            **self.special_tokens,
        }
        template = self.exported_chat_template() if bos_in_template else self.chat_template
        if template is not None:
            config["chat_template"] = template
        _write_atomic(folder / "tokenizer.json", self.backend.to_str(pretty=True))
        _write_atomic(folder / "tokenizer_config.json", config)
        _write_atomic(folder / "special_tokens_map.json", self.special_tokens)


def train_bpe(
    texts: Iterable[str],
    vocab_size: int,
    *,
    min_frequency: int = 2,
    special_tokens: Sequence[str] | None = None,
) -> Tokenizer:
    """Train a byte-level BPE tokenizer with the byte tokenizer's specials at the same ids and ChatML.

    Extra `special_tokens` take ids after the reserved ones; then the 256 bytes; then the merges.
    """
    specials = [*BYTE_SPECIALS, *BYTE_RESERVED, *(special_tokens or [])]
    floor = len(specials) + 256
    if vocab_size <= floor:
        raise TokenizerError(
            f"vocab_size={vocab_size} leaves no room for merges: {len(specials)} special tokens and 256 bytes "
            f"already take {floor} ids; pass vocab_size > {floor}"
        )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.train_from_iterator(texts, trainer=trainer)
    return Tokenizer(_byte_level_pipeline(backend, specials), BYTE_SPECIAL_TOKENS, CHATML_TEMPLATE)


def load_tokenizer(spec: str | Tokenizer) -> Tokenizer:
    """'byte' for the built-in byte-level tokenizer, else a Hugging Face tokenizer directory or hub id."""
    if isinstance(spec, Tokenizer):
        return spec
    return Tokenizer.byte_level() if spec == "byte" else Tokenizer.from_pretrained(resolve_tokenizer(spec))
