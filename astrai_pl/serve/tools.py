"""Tool calls in chat completions: the request's `tools` and tool messages checked for the chat template, and
the model's output read back as OpenAI's `tool_calls`, whole or streamed.

Two output formats, by vLLM's parser names:
- hermes (Hermes, Qwen, this project's default template): `<tool_call>{"name": …, "arguments": {…}}</tool_call>`,
  any number of them, text before the first is the message's content;
- llama3_json (Llama 3.x): the whole reply is one JSON object `{"name": …, "parameters": {…}}`, maybe after
  `<|python_tag|>`.
The parser is `--tool-call-parser`, else chosen from the template (`<tool_call>` in it: hermes; `<|python_tag|>`
or `"parameters"`: llama3_json). Output that does not parse as a call stays content. A reply with calls ends
with finish_reason "tool_calls". Streamed, content goes out as it comes (a possible `<tool_call>` opening is
held back until it is one or is not); each call goes out when it is whole: a first delta with its index, id,
type and name, then its arguments.
"""

from __future__ import annotations

import json
import secrets

from ..inference import GrammarError, StructuredOutput
from .errors import bad_request
from .messages import CHAT_ROLES, chat_messages

PARSERS = ("hermes", "llama3_json")
OPEN, CLOSE, PYTHON_TAG = "<tool_call>", "</tool_call>", "<|python_tag|>"
MAX_TOOLS = 128


def parser_for(template: str | None, chosen: str | None = None) -> str | None:
    """The output parser: `chosen` (--tool-call-parser), else the one the template's text implies, else None."""
    if chosen is not None:
        if chosen not in PARSERS:
            raise ValueError(f"--tool-call-parser {chosen!r}: pick one of {PARSERS}")
        return chosen
    if template and OPEN in template:
        return "hermes"
    if template and (PYTHON_TAG in template or '"parameters"' in template):
        return "llama3_json"
    return None


def check_tools(body, parser: str | None) -> list[dict] | None:
    """The request's tools as the template takes them (OpenAI's {"type": "function", "function": {...}}), or
    None when it has none or tool_choice is "none"; a 400 naming what is wrong otherwise."""
    if body.functions:
        raise bad_request("'functions' is OpenAI's deprecated form; send 'tools' with {\"type\": \"function\"}",
                          "functions")
    choice = body.tool_choice
    if choice is not None and choice not in ("none", "auto", "required") and forced_name(choice) is None:
        raise bad_request("'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                          "\"function\": {\"name\": NAME}}", "tool_choice")
    if not body.tools:
        if choice not in (None, "none", "auto"):
            raise bad_request("'tool_choice' forces a tool call, and the request has no 'tools'", "tool_choice")
        return None
    if len(body.tools) > MAX_TOOLS:
        raise bad_request(f"'tools' holds {len(body.tools)} tools, the server takes at most {MAX_TOOLS}", "tools")
    tools = [_checked_tool(tool, f"tools[{i}]") for i, tool in enumerate(body.tools)]
    if parser is None:
        raise bad_request("this model's chat template writes no tool calls the server can read; serve it with "
                          f"--tool-call-parser ({' or '.join(PARSERS)})", "tools")
    return None if choice == "none" else tools


def forced_name(choice) -> str | None:
    """The function a `tool_choice` object names ({"type": "function", "function": {"name": NAME}}), else None."""
    function = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    return name if isinstance(name, str) and name else None


def forced_call(choice, tools: list[dict] | None) -> StructuredOutput | None:
    """For `tool_choice` "required" or a named function: the JSON schema the reply is decoded under, one call
    {"name": NAME, "arguments": {...}} of a listed tool with arguments following its `parameters`; None when the
    model chooses (auto) or calls nothing."""
    if not tools or choice in (None, "none", "auto"):
        return None
    name = None if choice == "required" else forced_name(choice)
    chosen = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    if not chosen:
        raise bad_request(f"'tool_choice' names the function {name[:64]!r}, which 'tools' does not list",
                          "tool_choice.function.name")
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
              "properties": {"name": {"const": f["name"]}, "arguments": f.get("parameters") or {"type": "object"}}}
             for f in chosen]
    try:
        return StructuredOutput(json=calls[0] if len(calls) == 1 else {"anyOf": calls})
    except GrammarError as err:
        raise bad_request(f"'tools': {err}", "tools") from None


def _checked_tool(tool, where: str) -> dict:
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
        raise bad_request(f"'{where}' must be {{\"type\": \"function\", \"function\": {{\"name\", ...}}}}", where)
    name = function.get("name")
    if not isinstance(name, str) or not name or len(name) > 64:
        raise bad_request(f"'{where}.function.name' must be a name of 1 to 64 characters", f"{where}.function.name")
    for field, kind in (("description", str), ("parameters", dict)):
        if function.get(field) is not None and not isinstance(function[field], kind):
            raise bad_request(f"'{where}.function.{field}' must be a {kind.__name__}", f"{where}.function.{field}")
    return {"type": "function", "function": {k: v for k, v in function.items()
                                             if k in ("name", "description", "parameters", "strict")}}


def conversation(messages) -> list[dict]:
    """chat_messages, with OpenAI's tool messages: an assistant's `tool_calls` (arguments a JSON string, given
    to the template as an object) and `tool` results with their `tool_call_id`."""
    if not isinstance(messages, list) or not any(
            isinstance(m, dict) and (m.get("role") == "tool" or m.get("tool_calls")) for m in messages):
        return chat_messages(messages)
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if isinstance(message, dict) and message.get("role") == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str):
                raise bad_request(f"'{where}.tool_call_id' must name the call this result answers", where)
            [plain] = chat_messages([{"role": "user", "content": message.get("content")}])
            out.append({"role": "tool", "tool_call_id": call_id, "content": plain["content"]})
        elif isinstance(message, dict) and message.get("role") == "assistant" and message.get("tool_calls"):
            content = message.get("content") or ""
            [plain] = chat_messages([{"role": "assistant", "content": content}])
            out.append({**plain, "tool_calls": _checked_calls(message["tool_calls"], where)})
        else:
            out.extend(chat_messages([message]) if isinstance(message, dict) and message.get("role") in CHAT_ROLES
                       else _refused_message(message, where))
    return out


def _refused_message(message, where: str) -> list:
    chat_messages([message])  # raises the 400 that names the field
    return []


def _checked_calls(calls, where: str) -> list[dict]:
    if not isinstance(calls, list):
        raise bad_request(f"'{where}.tool_calls' must be an array of calls", f"{where}.tool_calls")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad_request(f"'{at}' must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                              "\"arguments\"}}}}", at)
        try:
            arguments = json.loads(function.get("arguments") or "{}")
        except (TypeError, ValueError):
            raise bad_request(f"'{at}.function.arguments' must be a JSON object as a string", at) from None
        out.append({"id": call.get("id"), "type": "function",
                    "function": {"name": function["name"], "arguments": arguments}})
    return out


# -- reading calls out of the model's text ----------------------------------------------------------------
def _call(obj, parser: str) -> dict | None:
    """OpenAI's tool call for one parsed object, or None when it is not a call."""
    key = "arguments" if parser == "hermes" else "parameters"
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(key, obj.get("arguments", {}))
    if not isinstance(arguments, dict):
        return None
    return {"id": f"call_{secrets.token_hex(12)}", "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _loads(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def parse_calls(text: str, parser: str) -> tuple[str | None, list[dict]]:
    """(content, tool calls) of a whole reply; the text itself as content when it holds no call."""
    if parser == "llama3_json":
        body = text.strip().removeprefix(PYTHON_TAG).strip()
        call = _call(_loads(body), parser) if body.startswith("{") else None
        return (None, [call]) if call else (text, [])
    head, _, rest = text.partition(OPEN)
    calls = []
    while rest:
        inside, closed, rest = rest.partition(CLOSE)
        call = _call(_loads(inside.strip()), parser) if closed else None
        if call is None:
            return text, []
        calls.append(call)
        rest = rest.strip()
        if rest and not rest.startswith(OPEN):
            return text, []
        rest = rest[len(OPEN):]
    return (head.strip() or None, calls) if calls else (text, [])


class ToolStream:
    """One streamed choice's text turned into delta fields: {"content": …} or {"tool_calls": [...]}."""

    def __init__(self, parser: str):
        self.parser, self.held, self.calls, self.started = parser, "", 0, False

    def feed(self, text: str) -> list[dict]:
        self.held += text
        if self.parser == "llama3_json":
            return self._feed_json()
        out = []
        while True:
            if not self.started:
                at = self.held.find(OPEN)
                if at < 0:
                    keep = len(self.held) if self.calls else _partial_suffix(self.held, OPEN)  # after a call:
                    if len(self.held) > keep:  # held until the next call or the end (where only text counts)
                        out.append({"content": self.held[: len(self.held) - keep]})
                        self.held = self.held[len(self.held) - keep:]
                    return out
                if self.held[:at].strip() or (at and not self.calls):  # not the whitespace between calls
                    out.append({"content": self.held[:at]})
                self.held, self.started = self.held[at + len(OPEN):], True
            inside, closed, rest = self.held.partition(CLOSE)
            if not closed:
                return out
            out += self._call_deltas(inside)
            self.held, self.started = rest, False

    def _feed_json(self) -> list[dict]:
        body = self.held.lstrip().removeprefix(PYTHON_TAG).lstrip()
        if not body or body.startswith("{") or PYTHON_TAG.startswith(self.held.lstrip()):
            return []  # a call, or too little to tell: held until the end
        self.parser = "text"
        out, self.held = [{"content": self.held}], ""
        return out

    def _call_deltas(self, inside: str) -> list[dict]:
        call = _call(_loads(inside.strip()), "hermes" if self.parser == "hermes" else "llama3_json")
        if call is None:
            return [{"content": f"{OPEN}{inside}{CLOSE}"}]
        index, self.calls = self.calls, self.calls + 1
        first = {"index": index, "id": call["id"], "type": "function",
                 "function": {"name": call["function"]["name"], "arguments": ""}}
        return [{"tool_calls": [first]},
                {"tool_calls": [{"index": index, "function": {"arguments": call["function"]["arguments"]}}]}]

    def finish(self) -> list[dict]:
        """What is still held when the reply ends: a last call, or text."""
        held, self.held = self.held, ""
        if self.parser == "llama3_json" and held.strip():
            body = held.strip().removeprefix(PYTHON_TAG).strip()
            deltas = self._call_deltas(body) if body.startswith("{") else []
            if deltas and "tool_calls" in deltas[0]:
                return deltas
        if self.started:
            held = OPEN + held
        return [{"content": held}] if held.strip() or (held and not self.calls) else []


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (what may yet become it)."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


# -- the chat response's pieces (protocol.ChatCall) ----------------------------------------------------------
def tool_choice(message: dict, finish_reason: str, parser: str) -> tuple[dict, str]:
    """A whole reply's message with its calls read out, and its finish_reason ("tool_calls" with calls)."""
    content, calls = parse_calls(message["content"], parser)
    if not calls:
        return message, finish_reason
    return {**message, "content": content, "tool_calls": calls}, "tool_calls"


def tool_chunks(streams: dict, index: int, delta, parser: str) -> list[dict]:
    """The stream choices ({"delta", "finish_reason"}) one engine delta of choice `index` makes."""
    stream = streams.setdefault(index, ToolStream(parser))
    fields = stream.feed(delta.text)
    if delta.finish_reason is not None:
        fields += stream.finish()
    out = [{"delta": f, "finish_reason": None} for f in fields]
    if delta.finish_reason is not None:
        finish = "tool_calls" if stream.calls else delta.finish_reason
        out.append({"delta": {}, "finish_reason": finish})
    elif not out:
        out.append({"delta": {"content": ""}, "finish_reason": None})  # a chunk per delta, as without tools
    return out
