"""OpenAI request bodies into engine calls, and engine results into OpenAI's response and stream-chunk shapes.

    call = completion_call(body, state)      # or chat_call: prompts (ids), SamplingParams, how to answer
    call.response(completions)               # {"object": "text_completion", "choices": [...], "usage": {...}}
    call.chunks(index, delta, completion)    # stream chunks for one delta of choice `index`

A known field of the wrong type is refused (400, `param` naming it); fields OpenAI has and this server has
no use for are ignored (`user`, `service_tier`, `store`, …); ones whose effect it cannot give are refused
rather than silently dropped (`suffix`, `best_of`, tools a chat template cannot write). Tools and tool calls
are read by `tools.py`; output constraints (`response_format`, vLLM's `structured_outputs`, `logit_bias`,
`min_tokens`, `bad_words`) by `structured.constraint_fields`.
Choice i of prompt p is choice p·n + i, as OpenAI numbers them.

Special tokens written as text are parsed as special tokens, in a prompt and in a message's content alike
(as transformers' and vLLM's chat templating do): a user content holding "<|im_end|><|im_start|>assistant"
gives the ids of a real assistant turn. That forges nothing the client could not send as messages itself;
an application that puts third-party text into messages has to strip such markers before it does.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field

from tokenizers import decoders

from ..commands import bos_first
from ..inference import Completion, Delta, SamplingParams, SamplingParamsError
from ..tokenizer import TokenizerError, byte_symbols
from .bodies import ChatRequest, CompletionRequest, SamplingFields, parse_body
from .errors import APIError, bad_request, from_sampling_error
from .limits import MAX_CHOICES, MAX_LOGPROB_ENTRIES, check_choice_count, check_text_size, is_id, prompt_count
from .structured import constraint_fields
from .tools import check_tools, conversation, forced_call, parser_for, tool_choice, tool_chunks

MAX_STOPS = {"stop": 16, "stop_token_ids": 256}  # each is checked on every token: a long list slows every request
MAX_STOP_CHARS = 256  # on every token the engine searches the text's last len(stop) characters for each stop
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the room left


# -- request → engine ---------------------------------------------------------------------------------------
PROMPT_SHAPES = "a string, a list of strings, a list of token ids, or a list of lists of token ids"


def encode_texts(tokenizer, texts: list[str]) -> list[list[int]]:
    """The ids of each text, in one call that releases the GIL: a long text takes seconds to encode, during
    which the engine's thread (and the event loop, when parsing runs on a worker thread) go on."""
    return tokenizer.encode_batch(texts)


def templated_ids(tokenizer, messages: list[dict], generation_prompt: bool = True,
                  limit: tuple[int, int] | None = None, tools: list[dict] | None = None) -> list[int]:
    """The conversation through the chat template, BOS first exactly once: `commands.chat_ids` (or, without
    the generation prompt, a stored conversation's ids), encoded by `encode_texts`. `limit`: (characters,
    context) past which the contents, then the rendered text, are refused before they are rendered or encoded."""
    if limit is not None:
        check_text_size(sum(len(m["content"]) for m in messages), *limit, "messages", "the messages' content")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False,
                                         **({"tools": tools} if tools else {}))
    if limit is not None:
        check_text_size(len(text), *limit, "messages", "the conversation through the chat template")
    [ids] = encode_texts(tokenizer, [text])
    return bos_first(tokenizer, ids)


def completion_prompts(prompt, tokenizer, limit: tuple[int, int] | None = None
                       ) -> tuple[list[list[int]], list[str | None]]:
    """Each prompt's ids, and its text when it came as text (None for ids). `limit`: (characters, context)
    past which a text is refused before it is encoded (`text_limit`)."""
    if isinstance(prompt, str):
        prompt = [prompt]
        if limit is not None:
            check_text_size(len(prompt[0]), *limit, "prompt", "the prompt")
        return encode_texts(tokenizer, prompt), prompt
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            for i, text in enumerate(prompt if limit is not None else ()):
                check_text_size(len(text), *limit, "prompt", f"prompt[{i}]")
            return encode_texts(tokenizer, prompt), list(prompt)
        if all(is_id(t) for t in prompt):
            return [list(prompt)], [None]
        if all(isinstance(p, list) and p and all(is_id(t) for t in p) for p in prompt):
            return [list(p) for p in prompt], [None] * len(prompt)
    raise bad_request(f"'prompt' must be {PROMPT_SHAPES}", "prompt")


def max_new_tokens(requested: int | None, prompt_len: int, context: int, default: int | None, param: str,
                   prompt_param: str) -> int | None:
    """The completion's length limit: `requested` if it fits beside the prompt in `context`, else a 400.

    None requested: `default`, cut to the room left (or all of it). Values SamplingParams refuses pass on."""
    if prompt_len >= context:
        raise bad_request(f"the prompt has {prompt_len} tokens, the context holds {context} (prompt and "
                          "completion together); shorten the prompt", prompt_param)
    room = context - prompt_len
    if requested is None:
        return room if default is None else min(default, room)
    if requested > room:
        raise bad_request(f"'{param}'={requested} and the prompt's {prompt_len} tokens need {requested + prompt_len}, "
                          f"the context holds {context}; ask for at most {room} tokens", param)
    return requested


def sampling_params(body: SamplingFields, max_tokens: int | None, extra_stop_ids: list[int], logprobs: bool,
                    top_logprobs: int, names: dict[str, str], prompt_logprobs: int | None = None,
                    constraints: dict | None = None) -> SamplingParams:
    """SamplingParams from the request's fields (OpenAI's defaults where left out); a refusal names the field."""
    given = {
        "max_tokens": max_tokens, "temperature": body.temperature, "top_p": body.top_p, "min_p": body.min_p,
        "presence_penalty": body.presence_penalty, "frequency_penalty": body.frequency_penalty,
        "repetition_penalty": body.repetition_penalty, "seed": body.seed, "n": body.n,
        "ignore_eos": body.ignore_eos, "skip_special_tokens": body.skip_special_tokens,
        "top_k": 0 if body.top_k == -1 else body.top_k,  # vLLM's -1: no top-k
        "stop": [] if body.stop is None else body.stop, "cache_salt": body.cache_salt,
    }
    fields = {k: v for k, v in given.items() if v is not None}
    stop_ids = [] if body.stop_token_ids is None else body.stop_token_ids
    for name, value in (("stop", fields["stop"]), ("stop_token_ids", stop_ids)):
        if isinstance(value, list) and len(value) > MAX_STOPS[name]:
            raise bad_request(f"'{name}' holds {len(value)} entries, the server takes at most {MAX_STOPS[name]}",
                              name)
    stop = fields["stop"]  # a wrong type is SamplingParams' to refuse
    for text in [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []:
        if isinstance(text, str) and len(text) > MAX_STOP_CHARS:
            raise bad_request(f"'stop' holds a string of {len(text)} characters, the server takes at most "
                              f"{MAX_STOP_CHARS} per stop string", "stop")
    try:
        params = SamplingParams(**fields, logprobs=logprobs, top_logprobs=top_logprobs, prompt_logprobs=prompt_logprobs,
                                stop_token_ids=stop_ids, **(constraints or {}))
        if not params.ignore_eos:  # the model's extra end ids (generation_config.json), as its own end ids
            params.stop_token_ids = list(dict.fromkeys([*params.stop_token_ids, *extra_stop_ids]))
        return params
    except SamplingParamsError as err:
        raise from_sampling_error(err, names) from None


# -- engine → response --------------------------------------------------------------------------------------
def usage(prompts: list[list[int]], completions: list[Completion], report_cached: bool = True) -> dict:
    """Token counts; each prompt counted once, its cached tokens those of its first sample (None in place of
    the details when the server keeps cache hits to itself)."""
    prompt_tokens = sum(len(p) for p in prompts)
    generated = sum(len(c.token_ids) for c in completions)
    cached = sum(c.cached_tokens for c in completions if c.index == 0)
    details = {"cached_tokens": cached} if report_cached else None
    return {"prompt_tokens": prompt_tokens, "completion_tokens": generated, "total_tokens": prompt_tokens + generated,
            "prompt_tokens_details": details}


@dataclass
class TokenLogprobs:
    """Per token: its id, its log-probability (None: the first prompt token), and the best alternatives."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    alternatives: list[list[tuple[int, float]] | None] = field(default_factory=list)


LOGPROB_FLOOR = -9999.0  # what OpenAI reports for a token of probability 0; JSON has no -inf


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else LOGPROB_FLOOR


def _finite_alternatives(alternatives) -> list[tuple[int, float]]:
    return [(token, _finite(logprob)) for token, logprob in alternatives]


def generated_logprobs(ids: list[int], logprobs, top) -> TokenLogprobs:
    """The log-probabilities of `ids` (engine lists; `top` may be None when no alternatives were asked)."""
    logprobs = [_finite(lp) for lp in (logprobs or [])[: len(ids)]]
    alternatives = [_finite_alternatives(a) for a in top] if top else [[] for _ in ids]
    return TokenLogprobs(list(ids[: len(logprobs)]), logprobs, alternatives[: len(logprobs)])


def prompt_token_logprobs(ids: list[int], prompt_logprobs) -> TokenLogprobs:
    entries = list(prompt_logprobs or [None] * len(ids))
    return TokenLogprobs(list(ids), [None if e is None else _finite(e[0]) for e in entries],
                         [None if e is None else _finite_alternatives(e[1]) for e in entries])


_BYTE_OF = {symbol: byte for byte, symbol in enumerate(byte_symbols())}


def token_bytes(tokenizer, token_id: int) -> bytes:
    """The bytes a token stands for: exact for a byte-level BPE vocabulary (each symbol of a piece is one
    byte, so a piece holding part of a character gives that part), else its text's UTF-8."""
    if isinstance(tokenizer.backend.decoder, decoders.ByteLevel):
        piece = tokenizer.id_to_token(token_id)
        if piece and all(ch in _BYTE_OF for ch in piece):
            return bytes(_BYTE_OF[ch] for ch in piece)
    return tokenizer.decode([token_id]).encode("utf-8")


class Call:
    """One parsed request: the prompts' ids, the SamplingParams, and how to shape what comes back."""

    object = ""
    chunk_object = ""
    salted = False  # True: its cache salt is already its session's (sessions_api.py), not the key's and body's

    def __init__(self, state, body: SamplingFields, prompts: list[list[int]], params: SamplingParams):
        self.tokenizer, self.model, self.prompts, self.params = state.tokenizer, state.model_name, prompts, params
        self.report_cached = state.report_cached_tokens
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.stream = bool(body.stream)
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        self.ids_as_names = bool(getattr(body, "return_tokens_as_token_ids", False))
        if body.stream_options is not None and not self.stream:
            raise bad_request("'stream_options' needs \"stream\": true", "stream_options")
        self.num_choices = len(prompts) * params.n
        if self.num_choices > MAX_CHOICES:
            raise bad_request(f"{len(prompts)} prompts × n={params.n} make {self.num_choices} completions, the "
                              f"server makes at most {MAX_CHOICES} per request; split the request",
                              "n" if len(prompts) == 1 else "prompt")
        if params.logprobs:
            scored = params.max_tokens + (max(map(len, prompts)) if params.prompt_logprobs is not None else 0)
            entries = self.num_choices * scored * (1 + params.top_logprobs)
            if entries > MAX_LOGPROB_ENTRIES:
                raise bad_request(f"{self.num_choices} completions × {scored} scored tokens × "
                                  f"{1 + params.top_logprobs} log-probabilities make {entries}, the server "
                                  f"keeps at most {MAX_LOGPROB_ENTRIES} per request; lower n, max_tokens or "
                                  "the alternatives asked for, or split the request", "logprobs")

    def token_text(self, token_id: int) -> str:
        """A token as logprobs name it: its text, or "token_id:<id>" when the request asked (vLLM's
        return_tokens_as_token_ids; a byte-level token's text alone may not say which token it was)."""
        return f"token_id:{token_id}" if self.ids_as_names else self.tokenizer.decode([token_id])

    def envelope(self, object: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": object, "created": self.created, "model": self.model, "choices": choices}

    def response(self, completions: list[Completion]) -> dict:
        """The whole answer; `completions` in choice order."""
        body = self.envelope(self.object, [self.choice(i, c) for i, c in enumerate(completions)])
        body["usage"] = usage(self.prompts, completions, self.report_cached)
        return body

    def chunk(self, choices: list[dict]) -> dict:
        body = self.envelope(self.chunk_object, choices)
        if self.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, completions: list[Completion]) -> dict:
        return {**self.envelope(self.chunk_object, []), "usage": usage(self.prompts, completions, self.report_cached)}

    def delta_logprobs(self, delta: Delta) -> TokenLogprobs | None:
        """The log-probabilities of the tokens a delta brings, when asked for."""
        if not self.params.logprobs:
            return None
        return generated_logprobs(delta.token_ids, delta.logprobs, delta.top_logprobs)


class CompletionCall(Call):
    object, chunk_object, id_prefix = "text_completion", "text_completion", "cmpl"

    def __init__(self, state, body: CompletionRequest, prompts, texts, params: SamplingParams, top: int | None):
        super().__init__(state, body, prompts, params)
        self.texts, self.echo, self.top = texts, bool(body.echo), top
        self.offsets = [0] * self.num_choices  # per choice: characters sent so far (text_offset)
        self.unechoed: set[int] = set()  # choices whose echoed prompt waits for its logprobs

    def prompt_text(self, p: int) -> str:
        text = self.texts[p]
        return self.tokenizer.decode(self.prompts[p]) if text is None else text

    def logprobs_body(self, entries: TokenLogprobs, offset: int) -> dict:
        tokens = [self.token_text(t) for t in entries.ids]
        offsets = []
        for text in tokens:
            offsets.append(offset)
            offset += len(text)
        tops = None if not self.top else [
            None if alts is None else {self.token_text(t): lp for t, lp in alts} for alts in entries.alternatives]
        return {"tokens": tokens, "token_logprobs": entries.logprobs, "top_logprobs": tops, "text_offset": offsets}

    def choice(self, index: int, c: Completion) -> dict:
        p = index // self.params.n
        text, logprobs = c.text, None
        if self.echo:
            text = self.prompt_text(p) + text
        if self.params.logprobs:
            entries = generated_logprobs(c.token_ids, c.logprobs, c.top_logprobs)
            if self.echo:
                head = prompt_token_logprobs(self.prompts[p], c.prompt_logprobs)
                entries = TokenLogprobs(head.ids + entries.ids, head.logprobs + entries.logprobs,
                                        head.alternatives + entries.alternatives)
            logprobs = self.logprobs_body(entries, 0)
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason}

    def opening_chunks(self) -> list[dict]:
        """With echo, each choice's first chunk is its prompt. Its logprobs are known once the prompt is
        computed, so with logprobs that chunk waits for the choice's first delta, which carries them."""
        if not self.echo:
            return []
        if self.params.logprobs:
            self.unechoed = set(range(self.num_choices))
            return []
        return [self.echo_chunk(index, None) for index in range(self.num_choices)]

    def echo_chunk(self, index: int, prompt_logprobs) -> dict:
        p = index // self.params.n
        text = self.prompt_text(p)
        self.offsets[index] = len(text)
        logprobs = None
        if self.params.logprobs:
            logprobs = self.logprobs_body(prompt_token_logprobs(self.prompts[p], prompt_logprobs), 0)
        return self.chunk([{"index": index, "text": text, "logprobs": logprobs, "finish_reason": None}])

    def chunks(self, index: int, delta: Delta) -> list[dict]:
        chunks = []
        if index in self.unechoed:
            self.unechoed.discard(index)
            scored = delta.prompt_logprobs
            if scored is None and delta.completion is not None:
                scored = delta.completion.prompt_logprobs
            chunks.append(self.echo_chunk(index, scored))
        entries = self.delta_logprobs(delta)
        logprobs = None if entries is None else self.logprobs_body(entries, self.offsets[index])
        self.offsets[index] += len(delta.text)
        return chunks + [self.chunk([{"index": index, "text": delta.text, "logprobs": logprobs,
                                      "finish_reason": delta.finish_reason}])]


class ChatCall(Call):
    object, chunk_object, id_prefix = "chat.completion", "chat.completion.chunk", "chatcmpl"

    def __init__(self, state, body: ChatRequest, prompts, params: SamplingParams, top: int,
                 tool_parser: str | None = None, named_call: bool = False):
        super().__init__(state, body, prompts, params)
        self.top, self.tool_parser = top, tool_parser  # tools.py reads calls out of the text with it
        self.tool_streams: dict = {}
        # a call the request named ends with "stop", as OpenAI's does; one the model chose with "tool_calls"
        self.call_finish = "stop" if named_call else "tool_calls"

    def logprobs_body(self, entries: TokenLogprobs) -> dict:
        def entry(token_id: int, logprob: float) -> dict:
            return {"token": self.token_text(token_id), "logprob": logprob,
                    "bytes": list(token_bytes(self.tokenizer, token_id))}

        content = [{**entry(t, lp), "top_logprobs": [entry(a, alp) for a, alp in alts or []][: self.top]}
                   for t, lp, alts in zip(entries.ids, entries.logprobs, entries.alternatives)]
        return {"content": content, "refusal": None}

    def choice(self, index: int, c: Completion) -> dict:
        logprobs = None
        if self.params.logprobs:
            logprobs = self.logprobs_body(generated_logprobs(c.token_ids, c.logprobs, c.top_logprobs))
        message = {"role": "assistant", "content": c.text, "refusal": None}
        if self.tool_parser is None:
            return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": c.finish_reason}
        message, finish = tool_choice(message, c.finish_reason, self.tool_parser)
        finish = self.call_finish if finish == "tool_calls" else finish
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}

    def opening_chunks(self) -> list[dict]:
        """Each choice's stream opens with the assistant role."""
        return [self.chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}]) for i in range(self.num_choices)]

    def chunks(self, index: int, delta: Delta) -> list[dict]:
        entries = self.delta_logprobs(delta)
        logprobs = None if entries is None else self.logprobs_body(entries)
        if self.tool_parser is not None:
            choices = tool_chunks(self.tool_streams, index, delta, self.tool_parser)
            for choice in choices:
                if choice["finish_reason"] == "tool_calls":
                    choice["finish_reason"] = self.call_finish
            return [self.chunk([{"index": index, "logprobs": logprobs if i == 0 else None, **choice}])
                    for i, choice in enumerate(choices)]
        content = {"content": delta.text} if delta.text or delta.finish_reason is None else {}
        return [self.chunk([{"index": index, "delta": content, "logprobs": logprobs,
                             "finish_reason": delta.finish_reason}])]


# -- the two routes' parsing --------------------------------------------------------------------------------
def completion_call(raw: dict, state) -> CompletionCall:
    body = parse_body(raw, CompletionRequest)
    state.check_model(body.model)
    if body.suffix:
        raise bad_request("'suffix' (insertion) is not supported by this server; leave it out", "suffix")
    if body.best_of is not None and body.best_of != (body.n or 1):
        raise bad_request("'best_of' is not supported by this server; ask for n completions instead", "best_of")
    if body.prompt is None:
        raise bad_request(f"'prompt' is required: {PROMPT_SHAPES}", "prompt")
    check_choice_count(prompt_count(body.prompt), body.n)  # before any prompt is encoded
    prompts, texts = completion_prompts(body.prompt, state.tokenizer, state.text_limit)
    longest = max(prompts, key=len)
    max_tokens = max_new_tokens(body.max_tokens, len(longest), state.context_len, COMPLETIONS_DEFAULT_MAX_TOKENS,
                                "max_tokens", "prompt")
    top = body.logprobs
    wants = top is not None
    echo_logprobs = top if body.echo and wants else None
    params = sampling_params(body, max_tokens, state.stop_token_ids, wants, top or 0,
                             {"top_logprobs": "logprobs", "prompt_logprobs": "logprobs"}, echo_logprobs,
                             constraint_fields(body, state))
    return CompletionCall(state, body, prompts, texts, params, top)


def chat_call(raw: dict, state) -> ChatCall:
    body = parse_body(raw, ChatRequest)
    state.check_model(body.model)
    parser = parser_for(state.tokenizer.chat_template, state.tool_call_parser)
    tools = check_tools(body, parser)
    forced = forced_call(body.tool_choice, tools)  # "required" or a named function: a call decoded under a schema
    if body.top_logprobs and not body.logprobs:
        raise bad_request("'top_logprobs' needs \"logprobs\": true", "top_logprobs")
    messages = conversation(body.messages)
    if state.tokenizer.chat_template is None:
        raise bad_request("this model's tokenizer has no chat template; use /v1/completions", "messages")
    try:
        ids = templated_ids(state.tokenizer, messages, limit=state.text_limit, tools=tools)
    except TokenizerError as err:
        raise bad_request(str(err), "messages") from None
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    n = body.n if body.n is not None and body.n >= 1 else 1  # a bad n is SamplingParams' to refuse
    fits = state.pool_room(n) - len(ids)  # left out, max_tokens is the room each of n samples has in the pool
    max_tokens = max_new_tokens(requested, len(ids), state.context_len, fits if fits > 0 else None, param,
                                "messages")
    constraints = constraint_fields(body, state, forced)
    params = sampling_params(body, max_tokens, state.stop_token_ids, bool(body.logprobs), body.top_logprobs or 0,
                             {"max_tokens": param}, constraints=constraints)
    # a forced call is the bare JSON object, which the llama3_json reading takes whatever the template's format
    reading = "llama3_json" if forced is not None else parser if tools else None
    named = forced is not None and body.tool_choice != "required"
    return ChatCall(state, body, [ids], params, body.top_logprobs or 0, reading, named_call=named)


def raise_for_finish(completions: list[Completion | None]) -> None:
    """An aborted sample (the server is shutting down) is a 503; the others are answered."""
    if any(c is None or c.finish_reason == "abort" for c in completions):
        raise APIError(503, "the request was aborted: the server is shutting down; retry", type="server_error")
