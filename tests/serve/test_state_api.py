"""A session's state over HTTP: export and upload on both kinds of model (the upload checked as a local file is),
and on an RWKV model blend, scale, inspect and distance; attention sessions refuse those with a 400."""

import contextlib
import json
import struct
import time

import httpx
import pytest
import test_cli_rwkv
from safetensors import safe_open
from safetensors.torch import load as load_bytes
from safetensors.torch import save as save_bytes
from served import MODEL, TIMEOUT, running

from astrai_pl.commands import load_engine
from astrai_pl.serve import state_api
from astrai_pl.serve.cli import serve_parser
from astrai_pl.serve.sessions_api import SessionStore
from astrai_pl.serve.state import ServerState

rwkv_dir = test_cli_rwkv.rwkv_dir
GREEDY = {"max_tokens": 6, "temperature": 0}
FILE = {"Content-Type": "application/octet-stream"}


@contextlib.contextmanager
def serving(engine, tokenizer, name, api_key=None):
    state = ServerState(engine, tokenizer, name, api_key=api_key, sessions=SessionStore(engine))
    with running(state) as url, httpx.Client(base_url=url, timeout=TIMEOUT) as http:
        yield http, state
        state.sessions.close_all()


@pytest.fixture(scope="module")
def rwkv(rwkv_dir):
    ns = serve_parser().parse_args(["--model", str(rwkv_dir), "--max-total-tokens", "4096"])
    engine, tok, _ = load_engine(ns)
    with serving(engine, tok, "rwkv") as pair:
        yield pair


@pytest.fixture(scope="module")
def attention(engine, tokenizer):
    with serving(engine, tokenizer, MODEL) as pair:
        yield pair


def ok(response):
    assert response.status_code == 200, response.text
    return response.json() if response.headers["content-type"].startswith("application/json") else response


def refused(response, status, *words):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert all(w in error["message"] for w in words), error["message"]
    return error


def session(http, text):
    sid = ok(http.post("/v1/sessions", json={"messages": [{"role": "system", "content": text}]}))["id"]
    ok(http.post(f"/v1/sessions/{sid}/chat/completions", json={"messages": user("Hi!"), **GREEDY}))
    return sid


def user(text):
    return [{"role": "user", "content": text}]


def reply(http, sid, text="And then?"):
    answer = ok(http.post(f"/v1/sessions/{sid}/chat/completions", json={"messages": user(text), **GREEDY}))
    return answer["choices"][0]["message"]["content"]


def fork(http, sid):
    return ok(http.post(f"/v1/sessions/{sid}/fork"))["id"]


def distances(http, a, b):
    rows = ok(http.get(f"/v1/sessions/{a}/distance", params={"other": b}))["data"]
    return {(r["layer"], r["component"]): r["l2"] for r in rows}


def test_blend_at_the_ends_is_either_state_and_answers_like_it(rwkv):
    http, state = rwkv
    a, b = session(http, "Be brief."), session(http, "Talk a lot about cats and dogs.")
    assert any(distances(http, a, b).values())
    first, last = (ok(http.post(f"/v1/sessions/{a}/blend", json={"other": b, "alpha": x}))["id"] for x in (0, 1))
    assert set(distances(http, first, a).values()) == {0.0}
    assert set(distances(http, last, b).values()) == {0.0}
    half = ok(http.post(f"/v1/sessions/{a}/blend", json={"other": b, "alpha": 0.5}))["id"]
    assert all(distances(http, half, a).values()) and all(distances(http, half, b).values())
    assert reply(http, first) == reply(http, fork(http, a))
    assert reply(http, last) == reply(http, fork(http, b))
    refused(http.post(f"/v1/sessions/{a}/blend", json={"other": b, "alpha": 1.5}), 400, "alpha=1.5", "[0, 1]")
    refused(http.post(f"/v1/sessions/{a}/blend", json={"other": "sess_nope", "alpha": 0.5}), 404, "sess_nope")
    refused(http.post(f"/v1/sessions/{a}/blend", json={"alpha": 0.5}), 400, "other")


def test_scale_edits_the_state_in_place_and_bad_edits_name_their_field(rwkv):
    http, state = rwkv
    sid = session(http, "Be brief.")
    layers = state.engine.model.config.num_hidden_layers
    stats = ok(http.get(f"/v1/sessions/{sid}/inspect"))["data"]
    assert len(stats) == layers * 4 and {r["component"] for r in stats} == {
        "ffn_shift", "att_shift", "numerator", "denominator"}
    assert all(r["l2"] > 0 for r in stats if r["component"] == "denominator")
    ok(http.post(f"/v1/sessions/{sid}/scale", json={"component": "history", "factor": 0, "layers": [0]}))
    after = {(r["layer"], r["component"]): r for r in ok(http.get(f"/v1/sessions/{sid}/inspect"))["data"]}
    assert after[(0, "numerator")]["l2"] == after[(0, "denominator")]["l2"] == 0.0
    assert after[(layers - 1, "denominator")]["l2"] > 0  # the other layers are as they were
    reply(http, sid)  # the edited state goes on answering
    refused(http.post(f"/v1/sessions/{sid}/scale", json={"component": "kv", "factor": 2}), 400, "component='kv'")
    refused(http.post(f"/v1/sessions/{sid}/scale", json={"component": "aa", "factor": 2, "layers": [99]}), 400,
            "99", f"0..{layers - 1}")
    refused(http.post(f"/v1/sessions/{sid}/scale", json={"component": "bb", "factor": -1}), 400, "factor=-1")


def exported(http, state, sid, tmp_path):
    """The file GET /state sends, checked against what Session.save writes for the same session: the same
    tensors and header, and the session's messages (the header's key order is the writer's own)."""
    data = ok(http.get(f"/v1/sessions/{sid}/state")).content
    stored = state.sessions.get(sid)
    stored.session.save(tmp_path / "local.safetensors")
    local = (tmp_path / "local.safetensors").read_bytes()
    assert header(data)["__metadata__"] == {**header(local)["__metadata__"], "messages": json.dumps(stored.messages)}
    got, want = load_bytes(data), load_bytes(local)
    assert got.keys() == want.keys() and all(got[k].equal(want[k]) for k in got)
    return data


def header(data: bytes) -> dict:
    size = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8 : 8 + size])


@pytest.mark.parametrize("kind", ["rwkv", "attention"])
def test_an_exported_session_uploads_into_a_session_that_answers_like_it(kind, request, tmp_path):
    http, state = request.getfixturevalue(kind)
    sid = session(http, "Be brief.")
    data = exported(http, state, sid, tmp_path)
    made = ok(http.post("/v1/sessions?ttl=30", content=data, headers=FILE))
    assert made["tokens"] == state.sessions.get(sid).describe()["tokens"] and made["id"] != sid
    twin = fork(http, sid)
    assert reply(http, made["id"]) == reply(http, twin)
    assert reply(http, made["id"], "More.") == reply(http, twin, "More.")
    local = (tmp_path / "local.safetensors").read_bytes()  # Session.save's file, without messages, loads too
    assert ok(http.post("/v1/sessions", content=local, headers=FILE))["messages"] == 0


def tampered(data: bytes, name: str, change, **entries) -> bytes:
    """`data` (a safetensors file) with tensor `name` changed by `change` and header `entries` set."""
    tensors = load_bytes(data)
    tensors[name] = change(tensors[name])
    return save_bytes(tensors, metadata={**header(data)["__metadata__"], **entries})


@pytest.mark.parametrize("kind", ["rwkv", "attention"])
def test_an_upload_is_checked_as_a_local_file_and_refused_naming_what_is_wrong(kind, request, tmp_path,
                                                                                monkeypatch):
    http, state = request.getfixturevalue(kind)
    data = exported(http, state, session(http, "Be brief."), tmp_path)
    live = len(state.sessions)
    refused(http.post("/v1/sessions", content=b"not a file", headers=FILE), 400, "the uploaded session file")
    refused(http.post("/v1/sessions", content=b"", headers=FILE), 400, "empty")
    name = "aa" if kind == "rwkv" else "k"
    nan = tampered(data, name, lambda t: t * float("nan"))
    refused(http.post("/v1/sessions", content=nan, headers=FILE), 400, "the uploaded session file", name, "NaN")
    outside = tampered(data, "token_ids" if kind == "rwkv" else "tokens", lambda t: t + 10**6)
    refused(http.post("/v1/sessions", content=outside, headers=FILE), 400, "outside the vocabulary")
    refused(http.post("/v1/sessions?ttl=-1", content=data, headers=FILE), 400, "ttl")
    for messages in ("[1]", "{", '[{"role": "robot", "content": "x"}]'):
        bad = tampered(data, name, lambda t: t, messages=messages)
        refused(http.post("/v1/sessions", content=bad, headers=FILE), 400, "the uploaded session file", "messages")
    monkeypatch.setattr(state_api, "MAX_BODY_BYTES", len(data) - 1)
    assert http.post("/v1/sessions", content=data, headers=FILE).status_code == 413
    assert len(state.sessions) == live  # nothing refused was kept
    with safe_open(str(tmp_path / "local.safetensors"), framework="pt") as f:
        assert f.metadata()["fingerprint"]


def test_a_file_of_one_model_is_refused_by_the_other(rwkv, attention, tmp_path):
    data = exported(*rwkv, session(rwkv[0], "Be brief."), tmp_path)
    refused(attention[0].post("/v1/sessions", content=data, headers=FILE), 400, "the uploaded session file")
    data = exported(*attention, session(attention[0], "Be brief."), tmp_path)
    refused(rwkv[0].post("/v1/sessions", content=data, headers=FILE), 400, "the uploaded session file")


def test_attention_sessions_refuse_the_state_operations_saying_why(attention):
    http, _ = attention
    a, b = session(http, "Be brief."), session(http, "Be long.")
    for response in (http.post(f"/v1/sessions/{a}/blend", json={"other": b, "alpha": 0.5}),
                     http.post(f"/v1/sessions/{a}/scale", json={"component": "aa", "factor": 0.5}),
                     http.get(f"/v1/sessions/{a}/inspect"),
                     http.get(f"/v1/sessions/{a}/distance", params={"other": b})):
        refused(response, 400, "RWKV", "attention K/V")
    assert reply(http, a)  # the session goes on


def test_the_state_routes_need_the_api_key_and_a_live_id(rwkv):
    _, state = rwkv
    engine, tokenizer = state.engine, state.tokenizer
    with serving(engine, tokenizer, "rwkv", api_key="sesame") as (http, _):
        key = {"Authorization": "Bearer sesame"}
        sid = ok(http.post("/v1/sessions", json={}, headers=key))["id"]
        for path in ("state", "inspect", f"distance?other={sid}"):
            refused(http.get(f"/v1/sessions/{sid}/{path}"), 401, "")
            assert http.get(f"/v1/sessions/{sid}/{path}", headers=key).status_code == 200
        refused(http.post(f"/v1/sessions/{sid}/scale", json={"component": "aa", "factor": 1}), 401, "")
        refused(http.post("/v1/sessions", content=b"x", headers=FILE), 401, "")
        refused(http.get("/v1/sessions/sess_guess/inspect", headers=key), 404, "sess_guess")


def test_a_turn_walked_away_from_leaves_an_edited_state_as_it_was(rwkv, monkeypatch):
    """An edited state does not follow from its tokens: an aborted turn must not recompute it from them."""
    http, state = rwkv
    sid = session(http, "Be brief.")
    ok(http.post(f"/v1/sessions/{sid}/scale", json={"component": "history", "factor": 0.25}))
    before = fork(http, sid)
    forward = state.engine.runner.forward
    monkeypatch.setattr(state.engine.runner, "forward", lambda plan: (time.sleep(0.02), forward(plan))[1])
    body = {"messages": user("Tell me a long story."), "max_tokens": 100, "temperature": 0, "stream": True}
    with http.stream("POST", f"/v1/sessions/{sid}/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                break  # the first text: walk away
    deadline = time.monotonic() + TIMEOUT
    while state.sessions.get(sid).busy:
        assert time.monotonic() < deadline, "the turn was not aborted"
        time.sleep(0.01)
    monkeypatch.undo()
    assert set(distances(http, sid, before).values()) == {0.0}
    assert reply(http, sid) == reply(http, before)
