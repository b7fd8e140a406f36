"""Requests an attacker or a sloppy client sends: each is refused in OpenAI's error shape naming its field (not
a 500), leaves nothing held in the engine, and the server answers the next request as before."""

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest
from served import MODEL, TIMEOUT
from test_errors import COMPLETIONS, error_of, still_serves
from test_metrics import requests_of, scrape

from astrai_pl.serve import generation
from astrai_pl.serve.app import create_app
from astrai_pl.serve.protocol import MAX_LOGPROB_ENTRIES
from astrai_pl.serve.protocol import templated_ids as rendered
from astrai_pl.serve.state import ServerState

CHAT = "/v1/chat/completions"
SESSIONS = "/v1/sessions"

CASES = [  # (route, raw JSON body, param the 400 names, words its message holds)
    (CHAT, b'{"messages": [{"role": ["user"], "content": "x"}]}', "messages[0].role", "one of"),
    (CHAT, b'{"messages": [{"role": {"a": 1}, "content": "x"}]}', "messages[0].role", "one of"),
    (COMPLETIONS, b'{"prompt": "\\ud800"}', "prompt", "surrogate"),
    (COMPLETIONS, b'{"prompt": ["a", "b\\udc00"]}', "prompt[1]", "surrogate"),
    (COMPLETIONS, b'{"prompt": "x", "model": "\\udfff"}', "model", "surrogate"),
    (COMPLETIONS, b'{"prompt": "x", "logit_bias": {"\\ud800": "a"}}', "logit_bias", "surrogate"),  # a key
    (CHAT, b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content", "surrogate"),
    (SESSIONS, b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
     "messages[0].content[0].text", "surrogate"),
    (COMPLETIONS, b'{"prompt": "x", "stop_token_ids": [1000000000000000000000000000000]}', "stop_token_ids",
     "outside the vocabulary"),
    (COMPLETIONS, b'{"prompt": "x", "n": 100}', "n", "max_batch_size"),
    # every token tests each tail of the text as long as the longest stop string, under the engine's lock
    (COMPLETIONS, json.dumps({"prompt": "x", "stop": "s" * 100_000}).encode(), "stop", "at most 256"),
    (CHAT, json.dumps({"messages": [{"role": "user", "content": "x"}], "stop": ["\n", "s" * 300]}).encode(), "stop",
     "300 characters"),
    # rendered by the chat template in Python before the prompt's length is known: 1M messages take seconds
    (CHAT, json.dumps({"messages": [{"role": "user", "content": ""}] * 8193}).encode(), "messages", "at most 8192"),
    # 128 × 500 × 21 log-probabilities held at once for a 1 kB request
    (COMPLETIONS, json.dumps({"prompt": ["x"] * 128, "max_tokens": 500, "logprobs": 20}).encode(), "logprobs",
     f"at most {MAX_LOGPROB_ENTRIES}"),
]


@pytest.mark.parametrize(("route", "body", "param", "words"), CASES, ids=[f"{i}-{c[2]}" for i, c in enumerate(CASES)])
def test_a_malformed_field_is_a_400_naming_it_and_the_server_goes_on(http, engine, route, body, param, words):
    error = error_of(http.post(route, content=body, headers={"Content-Type": "application/json"}), 400)
    assert error["param"] == param and words in error["message"], error
    assert engine.usage().in_use == 0
    still_serves(http)


def test_a_paired_surrogate_escape_is_a_character(http):
    """The check for lone surrogates leaves the escapes of JSON encoders that write ASCII (an emoji) alone."""
    r = http.post(COMPLETIONS, content=b'{"prompt": "\\ud83d\\ude00", "max_tokens": 1}',
                  headers={"Content-Type": "application/json"})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len("\N{GRINNING FACE}".encode())


def test_a_client_gone_before_its_body_is_whole_is_a_499_not_a_server_error(http, url):
    before = scrape(http)
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=TIMEOUT) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b'Content-Length: 1000\r\n\r\n{"prompt": "half a bo')
        time.sleep(0.2)  # the server has started reading the body
    deadline = time.monotonic() + TIMEOUT
    while requests_of(scrape(http), COMPLETIONS, 499) == requests_of(before, COMPLETIONS, 499):
        assert time.monotonic() < deadline, "the cut-off request was never counted"
        time.sleep(0.05)
    assert requests_of(scrape(http), COMPLETIONS, 500) == requests_of(before, COMPLETIONS, 500)
    still_serves(http)


def _asgi_scope(path: str) -> dict:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "",
            "query_string": b"", "headers": [(b"content-type", b"application/json")],
            "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}


def test_a_stream_whose_client_stops_reading_ends_and_frees_its_slot(engine, tokenizer, monkeypatch):
    """A client that keeps its connection open but reads nothing (every send of the body blocks) would hold
    its --max-queue slot forever; after STALL_TIMEOUT_S the stream ends and its requests are aborted."""
    monkeypatch.setattr(generation, "STALL_TIMEOUT_S", 0.2)
    state = ServerState(engine, tokenizer, MODEL, max_queue=1)
    app = create_app(state)
    body = json.dumps({"prompt": "x", "max_tokens": 400, "ignore_eos": True, "stream": True}).encode()

    async def stalled_client() -> list[str]:
        messages = [{"type": "http.request", "body": body, "more_body": False}]
        started = []

        async def receive():
            if messages:
                return messages.pop()
            await asyncio.Event().wait()  # never disconnects

        async def send(message):
            if message["type"] == "http.response.start":
                started.append(message["status"])
            else:
                await asyncio.Event().wait()  # never reads

        await asyncio.wait_for(app(_asgi_scope(COMPLETIONS), receive, send), TIMEOUT)
        return started

    assert asyncio.run(stalled_client()) == [200]
    assert state.in_flight == 0 and not state.handles
    deadline = time.monotonic() + TIMEOUT
    while engine.usage().in_use or engine.load() != (0, 0):
        assert time.monotonic() < deadline, f"the stalled stream's request still holds {engine.usage()}"
        time.sleep(0.02)


def test_a_session_whose_creator_left_during_its_prefill_is_closed(http, url, state, engine, tokenizer,
                                                                   monkeypatch):
    """Its id would reach no one, so it would pin its pages until its TTL; it is closed once computed."""
    warm = [{"role": "system", "content": "Warm context " * 30}]
    marker = rendered(tokenizer, warm, generation_prompt=False)
    computed, forward = threading.Event(), engine.runner.forward

    def gated_forward(plan):  # the warm prompt's prefill waits until its client has gone
        if any(req.tokens[: len(marker)] == marker for req, _ in plan):
            computed.wait(TIMEOUT)
        return forward(plan)

    monkeypatch.setattr(engine.runner, "forward", gated_forward)
    live = len(state.sessions)
    host, port = url.removeprefix("http://").rsplit(":", 1)
    body = json.dumps({"messages": warm}).encode()
    with socket.create_connection((host, int(port)), timeout=TIMEOUT) as s:
        s.sendall(b"POST /v1/sessions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + TIMEOUT
        while len(state.sessions) == live:
            assert time.monotonic() < deadline, "the session was never opened"
            time.sleep(0.01)
    computed.set()
    deadline = time.monotonic() + 10
    while len(state.sessions) > live or engine.usage().in_use:
        assert time.monotonic() < deadline, f"{len(state.sessions) - live} orphan session(s) hold {engine.usage()}"
        time.sleep(0.02)
    monkeypatch.undo()
    still_serves(http)


@pytest.mark.parametrize("route", [COMPLETIONS, CHAT, SESSIONS, "turn"])
def test_a_prompt_that_takes_long_to_tokenize_does_not_stall_the_others(http, url, tokenizer, route, monkeypatch):
    """A 32 MB prompt takes the tokenizer a minute; meanwhile the server answers everyone else. (The encode
    of a marked text waits here for the other request to be answered, or for the timeout on a stalled loop.)"""
    marker, answered, entered = "SLOW-TO-ENCODE", threading.Event(), threading.Event()

    def slow(encode, texts_of):
        def encoding(text, *args, **kwargs):
            if any(marker in t for t in texts_of(text)):
                entered.set()
                answered.wait(TIMEOUT)
            return encode(text, *args, **kwargs)

        return encoding

    monkeypatch.setattr(tokenizer, "encode", slow(tokenizer.encode, lambda text: [text]))
    monkeypatch.setattr(tokenizer, "encode_batch", slow(tokenizer.encode_batch, list))
    messages = [{"role": "user", "content": marker}]
    sessions = []
    if route == "turn":
        sessions.append(http.post(SESSIONS, json={}).json()["id"])
        route = f"{SESSIONS}/{sessions[0]}/chat/completions"
    body = {"prompt": marker} if route == COMPLETIONS else {"messages": messages}
    if route != SESSIONS:
        body["max_tokens"] = 1
    answers = []
    slow = threading.Thread(target=lambda: answers.append(http.post(route, json=body)))
    slow.start()
    try:
        assert entered.wait(TIMEOUT)
        other = httpx.post(f"{url}{COMPLETIONS}", json={"prompt": "Hello", "max_tokens": 2}, timeout=10)
        assert other.status_code == 200
    finally:
        answered.set()
        slow.join(TIMEOUT)
    assert [a.status_code for a in answers] == [200]
    if route == SESSIONS:
        sessions.append(answers[0].json()["id"])
    for session_id in sessions:
        assert http.delete(f"{SESSIONS}/{session_id}").status_code == 200
