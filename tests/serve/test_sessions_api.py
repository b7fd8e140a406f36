"""/v1/sessions over HTTP: a turn answers like a stateless chat on the whole conversation while computing only
the new tokens; forks, memory reports, limits, expiry and a client leaving mid-turn."""

import contextlib
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from served import MODEL, TIMEOUT, running

from astrai_pl.inference import SamplingParams
from astrai_pl.serve.cli import serve_parser
from astrai_pl.serve.protocol import templated_ids as rendered
from astrai_pl.serve.sessions_api import SessionStore
from astrai_pl.serve.state import ServerState

GREEDY = {"max_tokens": 8, "temperature": 0}
SYSTEM = [{"role": "system", "content": "Be brief."}]


@contextlib.contextmanager
def serving(engine, tokenizer, api_key=None, **limits):
    """A server on `engine` with its own session store; yields an httpx client on it and the state."""
    state = ServerState(engine, tokenizer, MODEL, api_key=api_key, sessions=SessionStore(engine, **limits))
    with running(state) as url, httpx.Client(base_url=url, timeout=TIMEOUT) as http:
        yield http, state
        state.sessions.close_all()


@pytest.fixture(scope="module")
def served(engine, tokenizer):
    with serving(engine, tokenizer) as pair:
        yield pair


@pytest.fixture
def http(served):
    return served[0]


def user(text):
    return [{"role": "user", "content": text}]


def create(http, messages=None, **body):
    r = http.post("/v1/sessions", json={**body, **({} if messages is None else {"messages": messages})})
    assert r.status_code == 200, r.text
    return r.json()


def turn(http, sid, messages, **params):
    r = http.post(f"/v1/sessions/{sid}/chat/completions", json={"messages": messages, **GREEDY, **params})
    assert r.status_code == 200, r.text
    return r.json()


def stateless(http, messages, **params):
    r = http.post("/v1/chat/completions", json={"messages": messages, **GREEDY, **params})
    assert r.status_code == 200, r.text
    return r.json()


def content(answer):
    return answer["choices"][0]["message"]["content"]


def streamed(http, path, body):
    """The streamed text of one choice and the usage chunk."""
    text, usage = "", None
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with http.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            assert "error" not in chunk, chunk
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                text += choice["delta"].get("content", "")
    return text, usage


def refused(response, status, code):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code
    return error


def test_turns_answer_like_stateless_chat_on_the_whole_conversation(http):
    session = create(http, SYSTEM)
    conversation, last = list(SYSTEM), None
    for question in ["Hi!", "And then?"]:
        answer = turn(http, session["id"], user(question))
        reference = stateless(http, conversation + user(question))
        assert content(answer) == content(reference)
        assert answer["object"] == "chat.completion" and answer["choices"][0]["finish_reason"] == "length"
        usage = answer["usage"]
        assert usage["prompt_tokens"] == reference["usage"]["prompt_tokens"]
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        if last is None:  # the system prompt was computed when the session was made
            assert cached == session["tokens"]
        else:  # the whole history but the last reply token, whose K/V a turn computes first
            assert cached == last["prompt_tokens"] + last["completion_tokens"] - 1
        conversation += user(question) + [{"role": "assistant", "content": content(answer)}]
        last = usage
    text, usage = streamed(http, f"/v1/sessions/{session['id']}/chat/completions",
                           {"messages": user("Why?"), **GREEDY})
    assert text == content(stateless(http, conversation + user("Why?")))
    assert usage["prompt_tokens_details"]["cached_tokens"] == last["total_tokens"] - 1


def test_a_fork_goes_its_own_way_and_leaves_its_parent_as_it_was(http):
    parent = create(http)
    first = turn(http, parent["id"], user("Hi!"))
    history = user("Hi!") + [{"role": "assistant", "content": content(first)}]
    child = http.post(f"/v1/sessions/{parent['id']}/fork").json()
    before = http.get(f"/v1/sessions/{parent['id']}").json()
    assert child["id"] != parent["id"] and child["tokens"] == before["tokens"]
    on_child = turn(http, child["id"], user("Tell me more."))
    assert content(on_child) == content(stateless(http, history + user("Tell me more.")))
    assert http.get(f"/v1/sessions/{parent['id']}").json()["tokens"] == before["tokens"]
    on_parent = turn(http, parent["id"], user("Bye."))
    assert content(on_parent) == content(stateless(http, history + user("Bye.")))
    assert http.get(f"/v1/sessions/{child['id']}").json()["tokens"] == on_child["usage"]["total_tokens"]


def test_get_follows_the_session_and_delete_frees_its_pages(http, engine, tokenizer):
    idle = engine.usage().in_use
    session = create(http, SYSTEM)
    warm = rendered(tokenizer, SYSTEM, generation_prompt=False)
    page = engine.usage().page_size
    bytes_per_page = engine.pool.storage.bytes_per_token * page
    assert session["object"] == "session" and session["tokens"] == len(warm)
    assert session["pages"] == -(-len(warm) // page) and session["bytes"] == session["pages"] * bytes_per_page
    assert session["expires_at"] >= session["created"]
    answer = turn(http, session["id"], user("Hi!"), max_tokens=40)
    after = http.get(f"/v1/sessions/{session['id']}").json()
    assert after["tokens"] == answer["usage"]["total_tokens"] > session["tokens"]
    assert after["pages"] == -(-(after["tokens"] - 1) // page) > session["pages"]  # the last token has no K/V
    assert engine.usage().in_use > idle
    deleted = http.delete(f"/v1/sessions/{session['id']}")
    assert deleted.json() == {"id": session["id"], "object": "session.deleted", "deleted": True}
    assert engine.check().in_use == idle
    refused(http.get(f"/v1/sessions/{session['id']}"), 404, "session_not_found")
    refused(http.post(f"/v1/sessions/{session['id']}/chat/completions", json={"messages": user("Hi!")}), 404,
            "session_not_found")
    refused(http.delete(f"/v1/sessions/{session['id']}"), 404, "session_not_found")
    assert create(http)["tokens"] == 0  # the server goes on


@contextlib.contextmanager
def gated_steps(engine, monkeypatch):
    """Every forward of the engine waits until the yielded event is set."""
    gate = threading.Event()
    forward = engine.runner.forward

    def waiting(plan):
        assert gate.wait(TIMEOUT), "the gate stayed shut"
        return forward(plan)

    monkeypatch.setattr(engine.runner, "forward", waiting)
    try:
        yield gate
    finally:
        gate.set()
        monkeypatch.undo()


def wait_for(condition, what):
    deadline = time.monotonic() + TIMEOUT
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_a_turn_while_another_runs_is_refused_and_then_served(served, engine, monkeypatch):
    http, state = served
    sid = create(http)["id"]
    with gated_steps(engine, monkeypatch) as gate, ThreadPoolExecutor(1) as pool:
        with httpx.Client(base_url=str(http.base_url), timeout=TIMEOUT) as other:
            running_turn = pool.submit(other.post, f"/v1/sessions/{sid}/chat/completions",
                                       json={"messages": user("Hi!"), **GREEDY})
            wait_for(lambda: state.sessions.get(sid).busy, "the first turn to start")
            error = refused(http.post(f"/v1/sessions/{sid}/chat/completions", json={"messages": user("Hey")}),
                            409, "session_busy")
            assert error["param"] == "session_id" and "wait" in error["message"]
            refused(http.post(f"/v1/sessions/{sid}/fork"), 409, "session_busy")
            gate.set()
            first = running_turn.result(TIMEOUT)
    assert first.status_code == 200
    history = user("Hi!") + [{"role": "assistant", "content": content(first.json())}]
    assert content(turn(http, sid, user("Hey"))) == content(stateless(http, history + user("Hey")))


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_leaving_mid_turn_aborts_it_and_the_history_stays(served, engine, monkeypatch, stream):
    http, state = served
    sid = create(http, SYSTEM)["id"]
    before = http.get(f"/v1/sessions/{sid}").json()
    forward = engine.runner.forward
    monkeypatch.setattr(engine.runner, "forward", lambda plan: (time.sleep(0.02), forward(plan))[1])
    path = f"/v1/sessions/{sid}/chat/completions"
    body = {"messages": user("Tell me a long story."), "max_tokens": 100, "temperature": 0, "stream": stream}
    if stream:
        with http.stream("POST", path, json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                    break  # the first text: walk away
    else:
        with pytest.raises(httpx.ReadTimeout):  # gives up waiting for the whole answer, and hangs up
            http.post(path, json=body, timeout=0.5)
        assert state.sessions.get(sid).busy, "the turn ended before the client left"
    wait_for(lambda: not state.sessions.get(sid).busy and engine.load() == (0, 0), "the turn to be aborted")
    monkeypatch.undo()
    assert http.get(f"/v1/sessions/{sid}").json()["tokens"] == before["tokens"]
    engine.check()
    assert content(turn(http, sid, user("Hi!"))) == content(stateless(http, SYSTEM + user("Hi!")))


def test_deleting_a_session_mid_turn_stops_the_turn_and_frees_the_pages(served, engine, monkeypatch):
    http, state = served
    idle = engine.usage().in_use
    sid = create(http, SYSTEM)["id"]
    forward = engine.runner.forward
    monkeypatch.setattr(engine.runner, "forward", lambda plan: (time.sleep(0.02), forward(plan))[1])
    body = {"messages": user("Tell me a long story."), "max_tokens": 100, "temperature": 0, "stream": True}
    chunks = []
    with http.stream("POST", f"/v1/sessions/{sid}/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunks.append(json.loads(line[6:]))
            if len(chunks) == 2:  # the role, then the first text: the turn runs
                assert http.delete(f"/v1/sessions/{sid}").json()["deleted"] is True
    monkeypatch.undo()
    assert chunks[-1]["error"]["code"] == "session_not_found" and "deleted during this turn" in str(chunks[-1])
    wait_for(lambda: engine.load() == (0, 0), "the turn to end")
    assert engine.check().in_use == idle
    refused(http.get(f"/v1/sessions/{sid}"), 404, "session_not_found")


def test_a_reply_cut_by_a_stop_string_keeps_its_tokens_and_the_next_turn_continues_them(http, engine,
                                                                                         tokenizer):
    full = content(stateless(http, user("Hi!")))
    cut = next(i for i in range(1, len(full)) if full[i] not in full[:i])
    sid = create(http)["id"]
    first = turn(http, sid, user("Hi!"), stop=[full[cut]])
    assert content(first) == full[:cut]
    held = rendered(tokenizer, user("Hi!"), generation_prompt=True) + tokenizer.encode(full[: cut + 1])
    history = user("Hi!") + [{"role": "assistant", "content": full[:cut]}]
    whole = rendered(tokenizer, history + user("More?"), generation_prompt=True)
    rest = whole[len(rendered(tokenizer, history, generation_prompt=False)):]  # the new turn, as rendered
    [reference] = engine.generate([held + rest], SamplingParams(**GREEDY))
    second = turn(http, sid, user("More?"))
    assert content(second) == reference.text
    assert second["usage"]["prompt_tokens"] == len(held + rest)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == len(held) - 1


def test_limits_refuse_with_429_until_room_is_made(engine, tokenizer):
    with serving(engine, tokenizer, max_sessions=1, max_tokens=64) as (http, _):
        first = create(http)
        error = refused(http.post("/v1/sessions", json={}), 429, "too_many_sessions")
        assert error["type"] == "rate_limit_error" and "--max-sessions" in error["message"]
        refused(http.post(f"/v1/sessions/{first['id']}/fork"), 429, "too_many_sessions")
        refused(http.post(f"/v1/sessions/{first['id']}/chat/completions",
                          json={"messages": user("Hi!" * 30), **GREEDY}), 429, "session_memory_full")
        assert turn(http, first["id"], user("Hi!"))["usage"]["completion_tokens"] == 8
        http.delete(f"/v1/sessions/{first['id']}")
        long_system = [{"role": "system", "content": "Be brief. " * 10}]
        error = refused(http.post("/v1/sessions", json={"messages": long_system}), 429, "session_memory_full")
        assert "--max-session-tokens" in error["message"]
        assert create(http, SYSTEM)["tokens"] == len(rendered(tokenizer, SYSTEM, generation_prompt=False))


def test_an_idle_session_expires_after_its_ttl(http, engine):
    idle = engine.usage().in_use
    session = create(http, SYSTEM, ttl=0.05)
    assert session["expires_at"] <= time.time() + 1
    time.sleep(0.2)
    refused(http.get(f"/v1/sessions/{session['id']}"), 404, "session_not_found")
    assert engine.check().in_use == idle
    error = refused(http.post("/v1/sessions", json={"ttl": 10**6}), 400, None)
    assert error["param"] == "ttl" and "--max-session-ttl" in error["message"]
    assert refused(http.post("/v1/sessions", json={"ttl": "soon"}), 400, None)["param"] == "ttl"


def test_a_session_opens_empty_with_no_messages_or_an_empty_list(http):
    opened = [http.post("/v1/sessions", json=body) for body in ({}, {"messages": []})]
    assert [r.status_code for r in opened] == [200, 200]
    assert [r.json()["tokens"] for r in opened] == [0, 0]
    assert content(turn(http, opened[1].json()["id"], user("Hi!"))) == content(stateless(http, user("Hi!")))


def test_bad_turns_name_their_field_and_the_session_goes_on(http):
    sid = create(http)["id"]
    path = f"/v1/sessions/{sid}/chat/completions"
    assert refused(http.post(path, json={"messages": user("Hi!"), "n": 2}), 400, None)["param"] == "n"
    assert refused(http.post(path, json={"messages": []}), 400, None)["param"] == "messages"
    refused(http.post(path, json={"messages": user("Hi!"), "model": "other"}), 404, "model_not_found")
    assert content(turn(http, sid, user("Hi!"))) == content(stateless(http, user("Hi!")))


def test_sessions_need_the_api_key(engine, tokenizer):
    with serving(engine, tokenizer, api_key="sesame") as (http, _):
        refused(http.post("/v1/sessions", json={}), 401, "invalid_api_key")
        key = {"Authorization": "Bearer sesame"}
        sid = http.post("/v1/sessions", json={}, headers=key).json()["id"]
        refused(http.get(f"/v1/sessions/{sid}"), 401, "invalid_api_key")
        refused(http.delete(f"/v1/sessions/{sid}"), 401, "invalid_api_key")
        assert http.get(f"/v1/sessions/{sid}", headers=key).status_code == 200


def test_the_session_options_reach_the_store_and_bad_ones_are_refused(engine):
    ns = serve_parser().parse_args(["--model", "m", "--max-sessions", "3", "--session-ttl", "5",
                                    "--max-session-ttl", "9", "--max-session-tokens", "160"])
    store = SessionStore(engine, ttl=ns.session_ttl, max_ttl=ns.max_session_ttl, max_sessions=ns.max_sessions,
                         max_tokens=ns.max_session_tokens)
    assert (store.ttl, store.max_ttl, store.max_sessions, store.max_pages) == (5, 9, 3, 160 // engine.page_size)
    with pytest.raises(SystemExit):
        serve_parser().parse_args(["--model", "m", "--session-ttl", "0"])
    with pytest.raises(ValueError, match="--max-session-ttl"):
        SessionStore(engine, ttl=10, max_ttl=5)
    with pytest.raises(ValueError, match="--max-session-tokens"):
        SessionStore(engine, max_tokens=1)
