"""The request fields that constrain what is generated, read into SamplingParams fields:

    response_format: {"type": "json_object"} | {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
    structured_outputs: {"json" | "regex" | "choice" | "grammar": ...}        (vLLM's extra body field)
    guided_json / guided_regex / guided_choice / guided_grammar                 (vLLM's older names)
    logit_bias, min_tokens, bad_words                                           (checked by SamplingParams)

At most one structured-output source per request. Its grammar is compiled here, against the served tokenizer,
so that a schema xgrammar cannot compile is a 400 naming the field and the part it could not take; the engine
then finds the compiled grammar in its cache.
"""

from __future__ import annotations

from typing import Any

from ..inference.grammar import GrammarError, StructuredOutput, compile_structured
from .errors import bad_request

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
KINDS = ("json", "regex", "choice", "grammar")


def constraint_fields(body, state, forced_call: StructuredOutput | None = None) -> dict[str, Any]:
    """SamplingParams keyword arguments for the request's constraints (only those it gave); `forced_call`: the
    schema of a tool call that `tool_choice` forces, which takes the place of a structured output."""
    fields: dict[str, Any] = {}
    for name in ("logit_bias", "min_tokens", "bad_words"):
        if getattr(body, name, None) is not None:
            fields[name] = getattr(body, name)
    spec = structured_output(body)
    if forced_call is not None:
        if spec is not None:
            raise bad_request("'tool_choice' forces a tool call, which is decoded under the call's own schema; leave "
                              f"out '{spec[1].split('.')[0]}' or set tool_choice to \"auto\"", "tool_choice")
        spec = forced_call, "tools"
    if spec is not None:
        spec, param = spec
        engine = state.engine
        try:
            compile_structured(spec, state.tokenizer, engine.model.config.vocab_size, list(engine.eos_token_ids))
        except GrammarError as err:
            raise bad_request(str(err), param) from None
        fields["structured"] = spec
    return fields


def structured_output(body) -> tuple[StructuredOutput, str] | None:
    """The request's structured-output spec and the field it came from, or None; a 400 for a malformed one."""
    found = []
    response_format = getattr(body, "response_format", None)
    if response_format is not None:
        spec = _from_response_format(response_format)
        if spec is not None:
            found.append(spec)
    if body.structured_outputs is not None:
        found.append(_from_structured_outputs(body.structured_outputs))
    for name, kind in GUIDED.items():
        value = getattr(body, name)
        if value is not None:
            found.append(_spec({kind: value}, name))
    if len(found) > 1:
        names = ", ".join(param.split(".")[0] for _, param in found)
        raise bad_request(f"the request constrains its output more than once ({names}); give one", found[1][1])
    return found[0] if found else None


def _from_response_format(value: dict) -> tuple[StructuredOutput, str] | None:
    kind = value.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return _spec({"json_object": True}, "response_format")
    if kind != "json_schema":
        raise bad_request(f"'response_format.type' must be \"text\", \"json_object\" or \"json_schema\", got "
                          f"{str(kind)[:40]!r}", "response_format.type")
    inner = value.get("json_schema")
    if not isinstance(inner, dict) or not isinstance(inner.get("schema"), dict):
        raise bad_request("'response_format.json_schema' must be {\"name\": str, \"schema\": {...}, \"strict\": bool} "
                          "with the JSON schema under \"schema\"", "response_format.json_schema.schema")
    return _spec({"json": inner["schema"]}, "response_format.json_schema.schema")


def _from_structured_outputs(value: dict) -> tuple[StructuredOutput, str]:
    given = [k for k in KINDS if value.get(k) is not None]
    if value.get("json_object"):
        given.append("json_object")
    if len(given) != 1:
        raise bad_request(f"'structured_outputs' needs exactly one of {', '.join(KINDS)}, got "
                          f"{given or 'none'}", "structured_outputs")
    kind = given[0]
    return _spec({kind: value[kind]}, f"structured_outputs.{kind}")


def _spec(fields: dict, param: str) -> tuple[StructuredOutput, str]:
    try:
        return StructuredOutput(**fields), param
    except GrammarError as err:
        raise bad_request(f"'{param}': {err}", param) from None
