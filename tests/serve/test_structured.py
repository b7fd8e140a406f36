"""Structured outputs and the other sampling constraints through the official `openai` client, on loopback,
against a random-weight debug model: whatever the weights, the text follows the schema, regex or choices."""

import json
import re

import jsonschema
import openai
import pytest
import torch
from served import MODEL, TIMEOUT, running

from astrai_pl.inference import Engine
from astrai_pl.model import ModelConfig, Transformer
from astrai_pl.serve.state import ServerState
from astrai_pl.tokenizer import BYTE_OFFSET, Tokenizer

pytest.importorskip("xgrammar")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "ok": {"type": "boolean"},
        "count": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 3},
    },
    "required": ["name", "ok", "count", "tags"],
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA, "strict": True}}
USER = [{"role": "user", "content": "Describe a record."}]


@pytest.fixture(scope="module")
def client():
    torch.manual_seed(0)
    tokenizer = Tokenizer.byte_level()  # a context for the template's tool preamble, which is long in bytes
    model = Transformer(ModelConfig.from_name("debug", max_position_embeddings=2048)).eval()
    engine = Engine(model, tokenizer, max_total_tokens=16384)
    with running(ServerState(engine, tokenizer, MODEL)) as base:
        with openai.OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=TIMEOUT, max_retries=0) as c:
            yield c
    engine.stop()


def valid(text: str) -> dict:
    value = json.loads(text)
    jsonschema.validate(value, SCHEMA)
    return value


@pytest.mark.parametrize("seed", [0, 100])
def test_chat_output_under_a_json_schema_always_validates(client, seed):
    reply = client.chat.completions.create(model=MODEL, messages=USER, response_format=RESPONSE_FORMAT, n=12,
                                           seed=seed, max_tokens=120)
    for choice in reply.choices:
        assert choice.finish_reason == "stop"
        valid(choice.message.content)
    assert len({c.message.content for c in reply.choices}) > 1  # sampled, not one forced string


def test_streamed_output_under_a_json_schema_validates(client):
    stream = client.chat.completions.create(model=MODEL, messages=USER, response_format=RESPONSE_FORMAT, n=6,
                                            seed=7, max_tokens=120, stream=True)
    texts = [""] * 6
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    for text in texts:
        valid(text)


def test_completions_take_vllm_structured_outputs_and_json_object(client):
    reply = client.completions.create(model=MODEL, prompt="Record:", max_tokens=120, n=8, seed=3,
                                      extra_body={"structured_outputs": {"json": SCHEMA}})
    for choice in reply.choices:
        valid(choice.text)
    objects = client.completions.create(model=MODEL, prompt="Object:", max_tokens=200, n=8, seed=4,
                                        extra_body={"response_format": {"type": "json_object"}})
    for choice in objects.choices:
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.text), dict)
        else:  # cut by max_tokens: still on its way to an object
            assert choice.text.startswith("{")
    assert any(c.finish_reason == "stop" for c in objects.choices)


@pytest.mark.parametrize("field", ["structured_outputs", "guided_choice"])
def test_a_choice_returns_one_of_the_choices(client, field):
    choices = ["positive", "negative", "neither of them"]
    body = {"structured_outputs": {"choice": choices}} if field == "structured_outputs" else {field: choices}
    reply = client.chat.completions.create(model=MODEL, messages=USER, n=16, seed=1, max_tokens=30, extra_body=body)
    assert all(c.message.content in choices for c in reply.choices)


def test_a_regex_is_matched(client):
    pattern = r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)"
    reply = client.completions.create(model=MODEL, prompt="Mail:", n=16, seed=2, max_tokens=30,
                                      extra_body={"guided_regex": pattern})
    assert all(re.fullmatch(pattern, c.text) for c in reply.choices)


def test_a_schema_xgrammar_cannot_compile_is_a_400_naming_it(client):
    schema = {"type": "object", "properties": {"x": {"type": "string", "pattern": "(?<=a)b"}}}
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=USER, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert bad.value.param == "response_format.json_schema.schema"
    assert "Lookbehind" in bad.value.message


def test_logit_bias_forces_and_bans(client):
    a, b = BYTE_OFFSET + ord("a"), BYTE_OFFSET + ord("b")
    forced = client.completions.create(model=MODEL, prompt="x", max_tokens=8, seed=0, logit_bias={str(a): 100})
    assert forced.choices[0].text == "a" * 8
    banned = client.completions.create(model=MODEL, prompt="x", max_tokens=40, seed=0, n=4,
                                       logit_bias={str(a): 100, str(b): 99, str(a + 2): -100})
    for choice in banned.choices:
        assert set(choice.text) <= {"a", "b"} and "a" in choice.text


def test_min_tokens_masks_the_end_until_reached(client):
    eos = Tokenizer.byte_level().eos_token_id
    bias = {str(eos): 100}  # the end is all but forced: without min_tokens the completion is empty
    plain = client.completions.create(model=MODEL, prompt="x", max_tokens=20, logit_bias=bias)
    assert plain.choices[0].text == "" and plain.choices[0].finish_reason == "stop"
    held = client.completions.create(model=MODEL, prompt="x", max_tokens=20, logit_bias=bias,
                                     extra_body={"min_tokens": 5})
    assert held.usage.completion_tokens == 6 and held.choices[0].finish_reason == "stop"


def test_bad_words_are_never_generated(client):
    a, b = BYTE_OFFSET + ord("a"), BYTE_OFFSET + ord("b")
    bias = {str(a): 50, str(b): 50}  # text of a's and b's: "ab" would come often
    free = client.completions.create(model=MODEL, prompt="x", max_tokens=40, n=4, seed=5, logit_bias=bias)
    assert any("ab" in c.text for c in free.choices)
    kept = client.completions.create(model=MODEL, prompt="x", max_tokens=40, n=4, seed=5, logit_bias=bias,
                                     extra_body={"bad_words": ["ab"]})
    for choice in kept.choices:
        assert "ab" not in choice.text and len(choice.text) == 40


def test_chat_takes_stop_token_ids(client):
    stop = BYTE_OFFSET + ord("q")
    reply = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=20, logit_bias={str(stop): 100},
                                           extra_body={"stop_token_ids": [stop]})
    assert reply.choices[0].finish_reason == "stop" and reply.usage.completion_tokens == 1


WEATHER = {"type": "function", "function": {"name": "wx", "parameters": {
    "type": "object", "properties": {"d": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["d"]}}}
TIME = {"type": "function", "function": {"name": "tz", "parameters": {
    "type": "object", "properties": {"z": {"enum": ["UTC", "CET"]}}, "required": ["z"]}}}
TOOLS = {"wx": WEATHER, "tz": TIME}
ASK = [{"role": "user", "content": "Hi"}]


def called(choice) -> list[tuple[str, dict]]:
    out = []
    for call in choice.message.tool_calls:
        arguments = json.loads(call.function.arguments)
        tool = TOOLS[call.function.name]
        jsonschema.validate(arguments, tool["function"]["parameters"])
        out.append((call.function.name, arguments))
    return out


@pytest.mark.parametrize("seed", [0, 7])
def test_a_named_tool_choice_always_gives_a_valid_call_of_that_function(client, seed):
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER, TIME], n=8, seed=seed, max_tokens=200,
        tool_choice={"type": "function", "function": {"name": "wx"}})
    for choice in reply.choices:
        assert choice.finish_reason == "stop" and choice.message.content is None  # OpenAI's for a forced call
        assert [name for name, _ in called(choice)] == ["wx"]


def test_required_gives_a_valid_call_of_one_of_the_tools_streamed_too(client):
    reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], n=8, seed=3,
                                           max_tokens=200, tool_choice="required")
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls" and len(called(choice)) == 1
    pieces, finish = {}, None
    for chunk in client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], seed=3,
                                                max_tokens=200, tool_choice="required", stream=True):
        for call in chunk.choices[0].delta.tool_calls or []:
            entry = pieces.setdefault(call.index, {"name": "", "arguments": ""})
            entry["name"] += call.function.name or ""
            entry["arguments"] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and len(pieces) == 1
    name, arguments = pieces[0]["name"], json.loads(pieces[0]["arguments"])
    jsonschema.validate(arguments, TOOLS[name]["function"]["parameters"])


def test_forced_tool_choices_that_cannot_be_met_are_400s_naming_the_field(client):
    cases = [({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
              "tool_choice.function.name"),
             ({"tool_choice": "required"}, "tool_choice"),
             ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
              "tool_choice"),
             ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice")]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2, extra_body=extra)
        assert caught.value.body["param"] == param, extra
