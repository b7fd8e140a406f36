"""A chat request's messages checked into {"role", "content": str}: the roles the chat template takes, text content
only, a bounded count; each refusal a 400 naming the message and field."""

from __future__ import annotations

from .errors import bad_request

MAX_MESSAGES = 8192  # messages of one conversation: the chat template renders them in Python
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def chat_messages(messages) -> list[dict[str, str]]:
    """The conversation as {"role", "content": str} messages; text content parts are joined."""
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty array of {\"role\", \"content\"} objects", "messages")
    if len(messages) > MAX_MESSAGES:
        raise bad_request(f"'messages' holds {len(messages)} messages, the server takes at most {MAX_MESSAGES} in "
                          "one conversation", "messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad_request(f"'{where}' must be an object with 'role' and 'content'", where)
        role = message.get("role")
        if role in ("tool", "function"):
            raise bad_request(f"'{where}.role' is {role!r}: tool calls are not supported by this server", f"{where}.role")
        if not isinstance(role, str) or role not in CHAT_ROLES:  # a list or object is not hashable
            raise bad_request(f"'{where}.role' must be one of {sorted(CHAT_ROLES)}, got {str(role)[:40]!r}",
                              f"{where}.role")
        if message.get("tool_calls"):
            raise bad_request(f"'{where}.tool_calls': tool calls are not supported by this server",
                              f"{where}.tool_calls")
        out.append({"role": CHAT_ROLES[role], "content": _content_text(message.get("content"), where)})
    return out


def _content_text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad_request(f"'{where}.content[{j}]' must be {{\"type\": \"text\", \"text\": str}}, got "
                                  f"{str(kind)[:40]!r}: this server takes text only", f"{where}.content[{j}]")
            texts.append(part["text"])
        return "".join(texts)
    raise bad_request(f"'{where}.content' must be a string or an array of text parts", f"{where}.content")
