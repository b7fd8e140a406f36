"""Tool calls in chat completions: the parsers on controlled text, and the openai client on loopback against
the debug model whose next-token logits are scripted (the engine's forward is wrapped so greedy decoding writes
a chosen reply): tools reach the template, calls come back as message.tool_calls and as streamed deltas, and
the tool result goes back as a `tool` message."""

import json

import openai
import pytest
import torch

from astrai_pl.serve.protocol import templated_ids
from astrai_pl.serve.tools import ToolStream, parse_calls, parser_for

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}  # short:
# the debug model's context is 512 tokens of one byte each
HERMES = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
          '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
LLAMA = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}'


def named(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_the_parsers_read_calls_and_leave_other_text_as_content():
    content, calls = parse_calls(HERMES, "hermes")
    assert content == "Let me check." and named(calls) == [("get_weather", {"city": "Paris"}),
                                                           ("get_weather", {"city": "Oslo"})]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert len({c["id"] for c in calls}) == 2
    assert named(parse_calls(LLAMA, "llama3_json")[1]) == [("get_weather", {"city": "Paris"})]
    for text, parser in (("just words", "hermes"), ("<tool_call>{not json}</tool_call>", "hermes"),
                         ("<tool_call>{\"name\": \"f\"", "hermes"), ('{"no": "name"}', "llama3_json"),
                         ("Sure: {\"name\": \"f\", \"parameters\": {}}", "llama3_json")):
        assert parse_calls(text, parser) == (text, [])
    assert parser_for("...<tool_call>...") == "hermes" and parser_for("{{ messages }}") is None
    assert parser_for(None, "llama3_json") == "llama3_json"
    with pytest.raises(ValueError, match="hermes"):
        parser_for(None, "mistral")


@pytest.mark.parametrize("text,parser", [(HERMES, "hermes"), (LLAMA, "llama3_json"), ("plain <tool text", "hermes"),
                                         ("plain words", "llama3_json")])
def test_streamed_one_character_at_a_time_gives_what_the_whole_text_gives(text, parser):
    stream = ToolStream(parser)
    deltas = [d for ch in text for d in stream.feed(ch)] + stream.finish()
    content = "".join(d.get("content", "") for d in deltas)
    calls: dict[int, dict] = {}
    for d in deltas:
        for piece in d.get("tool_calls", []):
            if "id" in piece:  # the first delta of a call: index, id, type, name
                assert piece["index"] not in calls and piece["function"]["arguments"] == ""
                calls[piece["index"]] = {"name": piece["function"]["name"], "arguments": ""}
            else:
                calls[piece["index"]]["arguments"] += piece["function"]["arguments"]
    whole_content, whole_calls = parse_calls(text, parser)
    assert content.strip() == (whole_content or "").strip()
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == named(whole_calls)


@pytest.fixture
def scripted(engine, tokenizer, monkeypatch):
    """script(text): the engine's greedy replies write `text`, then end (its forward's logits are replaced by
    a one-hot row at the script's next token: one request at a time)."""
    forward, box = engine.runner.forward, {"ids": []}

    def rigged(plan):
        ready, logits = forward(plan)
        for row, req in enumerate(ready):
            step = len(req.tokens) - req.num_prompt
            ids = box["ids"]
            logits[row] = -1e9
            logits[row, ids[step] if step < len(ids) else tokenizer.eos_token_id] = 0.0
        return ready, logits

    monkeypatch.setattr(engine.runner, "forward", rigged)
    return lambda text: box.update(ids=tokenizer.encode(text))


def test_a_tool_call_comes_back_as_message_tool_calls_and_the_result_goes_back(client, scripted):
    scripted(HERMES)
    asked = [{"role": "user", "content": "Weather in Paris and Oslo?"}]
    answer = client.chat.completions.create(model="debug-chat", messages=asked, tools=[WEATHER],
                                            temperature=0)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    calls = choice.message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})]
    scripted("Sunny in both.")
    follow = [*asked, choice.message.model_dump(exclude_none=True),
              *({"role": "tool", "tool_call_id": c.id, "content": "sunny"} for c in calls)]
    final = client.chat.completions.create(model="debug-chat", messages=follow, temperature=0)  # (no room
    # for the tools' header too in the debug model's context; the calls and results render without it)
    assert final.choices[0].message.content == "Sunny in both." and final.choices[0].finish_reason == "stop"
    assert not final.choices[0].message.tool_calls
    scripted(HERMES)  # with tool_choice "none" the tools are not offered and the text stays content
    plain = client.chat.completions.create(model="debug-chat", messages=asked, tools=[WEATHER], tool_choice="none",
                                           temperature=0)
    assert plain.choices[0].message.content == HERMES and plain.choices[0].finish_reason == "stop"


def test_a_tool_call_streams_as_openai_deltas(client, scripted):
    scripted(HERMES)
    stream = client.chat.completions.create(model="debug-chat", messages=[{"role": "user", "content": "Weather?"}],
                                            tools=[WEATHER], temperature=0, stream=True)
    content, calls, finish = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for piece in choice.delta.tool_calls or []:
                if piece.id:
                    calls[piece.index] = [piece.function.name, ""]
                calls[piece.index][1] += piece.function.arguments or ""
    assert content == "Let me check." and finish == "tool_calls"
    assert [(n, json.loads(a)) for n, a in calls.values()] == [("get_weather", {"city": "Paris"}),
                                                                ("get_weather", {"city": "Oslo"})]


def test_the_tools_and_tool_messages_reach_the_chat_template(tokenizer):
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                      "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    text = tokenizer.decode(templated_ids(tokenizer, messages, tools=[WEATHER]))
    assert '"name": "get_weather"' in text and "<tool_response>\nsunny\n</tool_response>" in text
    assert "<tools>" in text and '"city": "Paris"' in text


def test_bad_tools_and_choices_are_refused_naming_the_field(client):
    user = [{"role": "user", "content": "Hi"}]
    cases = [({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name"),
             ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
             ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
             ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
              "tool_choice.function.name")]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model="debug-chat", messages=user, max_tokens=2, extra_body=extra)
        assert caught.value.body["param"] == param, caught.value.body
    bad_result = [*user, {"role": "tool", "content": "sunny"}]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="debug-chat", messages=bad_result, max_tokens=2)
    assert "tool_call_id" in caught.value.body["message"]


def test_the_scripted_forward_is_what_writes_the_reply(client, scripted, engine):
    """The double works as the tests above assume: greedy output is the script, and not the model's own."""
    scripted("abc")
    got = client.chat.completions.create(model="debug-chat", messages=[{"role": "user", "content": "x"}],
                                         max_tokens=10, temperature=0)
    assert got.choices[0].message.content == "abc" and got.choices[0].finish_reason == "stop"
    assert torch.is_tensor(engine.model.lm_head.weight)


def test_the_tool_call_parser_option_is_vllms_and_refuses_others():
    from astrai_pl.serve.cli import serve_parser

    assert serve_parser().parse_args(["--model", "m", "--tool-call-parser", "llama3_json"]).tool_call_parser == (
        "llama3_json")
    assert serve_parser().parse_args(["--model", "m"]).tool_call_parser is None
    with pytest.raises(SystemExit):
        serve_parser().parse_args(["--model", "m", "--tool-call-parser", "mistral"])
