"""Every refusal comes back in OpenAI's error shape with its status and the field at fault, and the server
answers the next request as before."""

import openai
import pytest
from served import MODEL, TIMEOUT, running

from astrai_pl.serve import protocol
from astrai_pl.serve.state import ServerState

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]


def error_of(response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert list(body) == ["error"] and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def still_serves(http) -> None:
    ok = http.post(COMPLETIONS, json={"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"


CASES = [  # (route, body, status, param, words the message holds)
    (COMPLETIONS, b"{not json", 400, None, "not valid JSON"),
    (COMPLETIONS, b"[1, 2]", 400, None, "JSON object"),
    (COMPLETIONS, b"\xff\xfe", 400, None, "UTF-8"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens", "integer"),
    (COMPLETIONS, {"prompt": "x", "temperature": True}, 400, "temperature", "number"),
    (COMPLETIONS, {"prompt": "x", "stream": "yes"}, 400, "stream", "boolean"),
    (COMPLETIONS, {"prompt": "x", "stream_options": {"include_usage": 1}}, 400, "stream_options.include_usage",
     "boolean"),
    (COMPLETIONS, {"prompt": "x", "top_p": 2}, 400, "top_p", "(0, 1]"),
    (COMPLETIONS, {"prompt": "x", "temperature": -1}, 400, "temperature", ">= 0"),
    (COMPLETIONS, {"prompt": "x", "n": 0}, 400, "n", ">= 1"),
    (COMPLETIONS, {"prompt": "x", "n": 5000}, 400, "n", "at most 1024"),
    (COMPLETIONS, {"prompt": ["x"] * 600, "n": 2}, 400, "prompt", "at most 1024"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": -1}, 400, "max_tokens", ">= 0"),
    (COMPLETIONS, {"prompt": "x", "seed": -5}, 400, "seed", "2**64"),
    (COMPLETIONS, {"prompt": "x", "stop": 5}, 400, "stop", "list of strings"),
    (COMPLETIONS, {"prompt": "x", "stop": ["a"] * 17}, 400, "stop", "at most 16"),
    (COMPLETIONS, {"prompt": "x", "stop_token_ids": [3] * 300}, 400, "stop_token_ids", "at most 256"),
    (COMPLETIONS, {"prompt": "x", "stop_token_ids": [-1]}, 400, "stop_token_ids", "not a token id"),
    (COMPLETIONS, {"prompt": "x", "logprobs": 21}, 400, "logprobs", "at most 20"),
    (COMPLETIONS, {"prompt": "x", "logit_bias": {"9": 500}}, 400, "logit_bias", "outside [-100, 100]"),
    (COMPLETIONS, {"prompt": "x", "logit_bias": {"nine": 5}}, 400, "logit_bias", "not a token id"),
    (COMPLETIONS, {"prompt": "x", "logit_bias": {str(i): 1 for i in range(301)}}, 400, "logit_bias", "at most 300"),
    (COMPLETIONS, {"prompt": "x", "logit_bias": {"99999": 1}}, 400, "logit_bias", "outside the vocabulary"),
    (COMPLETIONS, {"prompt": "x", "min_tokens": -1}, 400, "min_tokens", ">= 0"),
    (COMPLETIONS, {"prompt": "x", "min_tokens": 9, "max_tokens": 3}, 400, "min_tokens", "max_tokens"),
    (COMPLETIONS, {"prompt": "x", "bad_words": [""]}, 400, "bad_words", "non-empty strings"),
    (COMPLETIONS, {"prompt": "x", "bad_words": "no"}, 400, "bad_words", "valid list"),
    (COMPLETIONS, {"prompt": "x", "structured_outputs": {"regex": "(?<=a)b"}}, 400, "structured_outputs.regex",
     "Lookbehind"),
    (COMPLETIONS, {"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["b"]}}, 400, "structured_outputs",
     "exactly one"),
    (COMPLETIONS, {"prompt": "x", "guided_choice": []}, 400, "guided_choice", "non-empty list"),
    (COMPLETIONS, {"prompt": "x", "guided_grammar": "root ::= nowhere"}, 400, "guided_grammar", "nowhere"),
    (COMPLETIONS, {"prompt": "x", "suffix": "y"}, 400, "suffix", "not supported"),
    (COMPLETIONS, {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options", "stream"),
    (COMPLETIONS, {"max_tokens": 3}, 400, "prompt", "required"),
    (COMPLETIONS, {"prompt": 5}, 400, "prompt", "list of token ids"),
    (COMPLETIONS, {"prompt": [1, "a"]}, 400, "prompt", "list of token ids"),
    (COMPLETIONS, {"prompt": [99999]}, 400, "prompt", "vocabulary"),
    (COMPLETIONS, {"prompt": ""}, 400, "prompt", "empty"),
    (COMPLETIONS, {"prompt": "x" * 600}, 400, "prompt", "600 tokens, the context holds 512"),
    (COMPLETIONS, {"prompt": "x" * 10, "max_tokens": 600}, 400, "max_tokens", "context holds 512"),
    (COMPLETIONS, {"prompt": "x", "model": "gpt-4"}, 404, "model", "does not exist"),
    (CHAT, {"messages": []}, 400, "messages", "non-empty"),
    (CHAT, {"messages": "hi"}, 400, "messages", "non-empty"),
    (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role", "one of"),
    (CHAT, {"messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0]", "tool_call_id"),
    (CHAT, {"messages": [{"role": "user", "content": 3}]}, 400, "messages[0].content", "string"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "messages[0].content[0]", "text only"),
    (CHAT, {"messages": USER, "response_format": {"type": "yaml"}}, 400, "response_format.type", "json_schema"),
    (CHAT, {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {}}}, 400,
     "response_format.json_schema.schema", "under \"schema\""),
    (CHAT, {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {
        "type": "string", "pattern": "(?<=a)b"}}}}, 400, "response_format.json_schema.schema", "Lookbehind"),
    (CHAT, {"messages": USER, "response_format": {"type": "json_object"}, "guided_regex": "a"}, 400, "guided_regex",
     "more than once"),
    (CHAT, {"messages": USER, "stop_token_ids": [99999]}, 400, "stop_token_ids", "vocabulary"),
    (CHAT, {"messages": USER, "tools": [{"type": "function", "function": {"name": ""}}]}, 400,
     "tools[0].function.name", "1 to 64"),
    (CHAT, {"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "always"},
     400, "tool_choice", "must be"),
    (CHAT, {"messages": USER, "top_logprobs": 2}, 400, "top_logprobs", "logprobs"),
    (CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 30}, 400, "top_logprobs", "at most 20"),
    (CHAT, {"messages": USER, "max_completion_tokens": 5000}, 400, "max_completion_tokens", "context holds 512"),
    (CHAT, {"messages": [{"role": "user", "content": "x" * 600}]}, 400, "messages", "the context holds 512"),
]


@pytest.mark.parametrize(("route", "body", "status", "param", "words"), CASES,
                         ids=[f"{i}-{c[3]}" for i, c in enumerate(CASES)])
def test_a_refused_request_names_its_field_and_the_server_goes_on(http, route, body, status, param, words):
    if isinstance(body, bytes):
        response = http.post(route, content=body, headers={"Content-Type": "application/json"})
    else:
        response = http.post(route, json={"model": MODEL, **body})
    error = error_of(response, status)
    assert error["param"] == param
    assert words in error["message"]
    still_serves(http)


def test_unknown_routes_and_methods_get_openai_errors(http):
    assert error_of(http.get("/v1/engines"), 404)["code"] == "not_found"
    assert error_of(http.get(COMPLETIONS), 405)["code"] == "method_not_allowed"
    still_serves(http)


def test_the_openai_client_raises_its_typed_errors(client):
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt="x", top_p=3.0)
    assert bad.value.param == "top_p"
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="nope", messages=USER)
    assert missing.value.code == "model_not_found"
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=1).choices[0].text is not None


def test_an_unforeseen_failure_is_a_500_in_openai_shape(http, monkeypatch):
    def broken(*args):
        raise RuntimeError("boom")

    monkeypatch.setattr(protocol, "completion_prompts", broken)
    error = error_of(http.post(COMPLETIONS, json={"prompt": "x"}), 500)
    assert error["type"] == "server_error" and "RuntimeError" in error["message"]
    monkeypatch.undo()
    still_serves(http)


def test_an_unforeseen_failure_mid_stream_ends_with_an_error_event_and_done(http, monkeypatch):
    def broken(self, index, delta):
        raise RuntimeError("boom")

    monkeypatch.setattr(protocol.CompletionCall, "chunks", broken)
    with http.stream("POST", COMPLETIONS, json={"prompt": "x", "max_tokens": 3, "stream": True}) as s:
        events = [line for line in s.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and '"server_error"' in events[-2] and "RuntimeError" in events[-2]
    monkeypatch.undo()
    still_serves(http)


def test_the_api_key_is_required_on_v1_only(engine, tokenizer):
    import httpx

    state = ServerState(engine, tokenizer, MODEL, api_key="sekrit")
    with running(state) as url, httpx.Client(base_url=url, timeout=TIMEOUT) as http:
        assert error_of(http.get("/v1/models"), 401)["code"] == "invalid_api_key"
        wrong = http.get("/v1/models", headers={"Authorization": "Bearer sekrit-not"})
        assert error_of(wrong, 401)["code"] == "invalid_api_key"
        assert error_of(http.get("/v1/models", headers={"Authorization": "Basic sekrit"}), 401)
        assert http.get("/health").status_code == 200
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
        right = openai.OpenAI(base_url=f"{url}/v1", api_key="sekrit", timeout=TIMEOUT, max_retries=0)
        assert right.completions.create(model=MODEL, prompt="x", max_tokens=2).usage.completion_tokens >= 1


def test_a_request_failing_in_the_engine_is_a_500_or_an_error_event_and_others_go_on(http, engine, tokenizer,
                                                                                     monkeypatch):
    poison = tokenizer.encode("POISON")
    forward = engine.runner.forward

    def failing_forward(plan):
        if any(poison == req.tokens[: len(poison)] for req, _ in plan):
            raise RuntimeError("injected failure")
        return forward(plan)

    monkeypatch.setattr(engine.runner, "forward", failing_forward)
    error = error_of(http.post(COMPLETIONS, json={"prompt": "POISON here", "max_tokens": 4}), 500)
    assert error["type"] == "server_error" and "injected failure" in error["message"]
    with http.stream("POST", COMPLETIONS, json={"prompt": "POISON again", "max_tokens": 4, "stream": True}) as s:
        events = [line for line in s.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and "injected failure" in events[-2]
    still_serves(http)


def test_a_body_over_the_limit_is_refused_with_413(http, monkeypatch):
    from astrai_pl.serve import generation

    monkeypatch.setattr(generation, "MAX_BODY_BYTES", 1000)
    error = error_of(http.post(COMPLETIONS, json={"prompt": "x" * 2000}), 413)
    assert error["code"] == "request_too_large"
    monkeypatch.undo()
    still_serves(http)
