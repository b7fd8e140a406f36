"""What one client may cost the server: text that cannot fit is refused before it is encoded, counts are
checked before any work, tokenizing runs on the server's own threads, a request's log-probabilities are
bounded as a whole; and the connection limits: no empty key, no open API description, a header timeout, a
connection cap and no session id in the access log."""

import logging
import socket
import threading
import time

import httpx
import pytest
from served import MODEL, TIMEOUT, running
from test_errors import CHAT, COMPLETIONS, error_of, still_serves

from astrai_pl.serve import protocol
from astrai_pl.serve.cli import serve_verb
from astrai_pl.serve.connections import ConnectionLimits, SessionIdFilter, server_config
from astrai_pl.serve.errors import APIError
from astrai_pl.serve.state import ServerState


@pytest.fixture
def encoded(monkeypatch):
    """(thread name, length of each text) for every call that encodes request text."""
    calls = []
    encode = protocol.encode_texts

    def spying(tokenizer, texts):
        calls.append((threading.current_thread().name, [len(t) for t in texts]))
        return encode(tokenizer, texts)

    monkeypatch.setattr(protocol, "encode_texts", spying)
    return calls


def test_text_that_cannot_fit_the_context_is_refused_before_it_is_encoded(http, encoded):
    big = "x" * 2**20  # the context holds 512 tokens, a token of the byte tokenizer stands for 14 characters at most
    for route, body in ((COMPLETIONS, {"prompt": big}), (COMPLETIONS, {"prompt": ["hi", big]}),
                        (CHAT, {"messages": [{"role": "user", "content": big}]})):
        error = error_of(http.post(route, json={"model": MODEL, "max_tokens": 1, **body}), 400)
        assert "characters" in error["message"] and error["param"] in ("prompt", "messages"), error
    assert all(n <= 512 * 14 for _, lengths in encoded for n in lengths), encoded
    still_serves(http)


def test_a_text_just_inside_the_bound_is_still_encoded_and_judged_by_its_tokens(http, state):
    limit, context = state.text_limit
    assert (limit, context) == (512 * len("<|reserved_5|>"), 512)  # its longest token: a special one
    error = error_of(http.post(COMPLETIONS, json={"model": MODEL, "prompt": "x" * limit, "max_tokens": 1}), 400)
    assert "tokens" in error["message"] and "characters" not in error["message"]


def test_counts_are_checked_before_any_prompt_is_encoded(http, encoded):
    many = http.post(COMPLETIONS, json={"model": MODEL, "prompt": ["x"] * 2000, "max_tokens": 1})
    assert "2000 prompts" in error_of(many, 400)["message"]
    wide = http.post(COMPLETIONS, json={"model": MODEL, "prompt": ["x"] * 64, "n": 32, "max_tokens": 1})
    assert "2048 completions" in error_of(wide, 400)["message"]
    assert encoded == []


def test_request_text_is_tokenized_on_the_servers_own_threads(http, encoded):
    still_serves(http)
    http.post(CHAT, json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    assert len(encoded) == 2 and all(name.startswith("astrai-tokenize") for name, _ in encoded), encoded


def test_a_requests_log_probabilities_are_bounded_as_a_whole(state):
    flood = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 64, "max_tokens": 480,
             "logprobs": True, "top_logprobs": 20}
    with pytest.raises(APIError) as refused:
        protocol.chat_call(flood, state)
    assert refused.value.status == 400 and refused.value.param == "logprobs"
    assert "645120" in refused.value.message
    protocol.chat_call({**flood, "n": 4}, state)  # 4 × 480 × 21 fits


def test_an_empty_api_key_is_refused(engine, tokenizer, monkeypatch, tmp_path):
    with pytest.raises(ValueError, match="empty"):
        ServerState(engine, tokenizer, MODEL, api_key="")
    with pytest.raises(ValueError, match="empty"):
        ServerState(engine, tokenizer, MODEL, api_key=["good", " "])
    missing = str(tmp_path / "no-model")  # refused before the model would be read
    with pytest.raises(SystemExit, match="empty"):
        serve_verb(["--model", missing, "--api-key", ""])
    monkeypatch.setenv("ASTRAI_API_KEY", "")
    with pytest.raises(SystemExit, match="empty"):
        serve_verb(["--model", missing])


def test_the_api_description_is_not_served(http):
    for path in ("/openapi.json", "/docs", "/redoc"):
        assert http.get(path).status_code == 404, path


def test_several_keys_each_let_their_client_in(engine, tokenizer):
    state = ServerState(engine, tokenizer, MODEL, api_key=["alpha", "beta"])
    with running(state) as url, httpx.Client(base_url=url, timeout=TIMEOUT) as http:
        for key in ("alpha", "beta"):
            assert http.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
        assert error_of(http.get("/v1/models", headers={"Authorization": "Bearer gamma"}), 401)


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closes `sock` (reads end) within `seconds`."""
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        pass
    return True


def test_a_client_that_never_finishes_its_headers_is_cut_off(engine, tokenizer):
    limits = ConnectionLimits(header_timeout=0.5)
    with running(ServerState(engine, tokenizer, MODEL), limits) as url:
        port = int(url.rpartition(":")[2])
        slow = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
        slow[0].sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: appl")
        slow[1].sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /health HTTP/1.1\r\nHo")  # kept alive
        try:
            assert all(closed_within(s, TIMEOUT) for s in slow)
        finally:
            for s in slow:
                s.close()
        with httpx.Client(base_url=url, timeout=TIMEOUT) as http:
            still_serves(http)


def test_connections_over_the_cap_are_closed_as_they_open(engine, tokenizer):
    with running(ServerState(engine, tokenizer, MODEL), ConnectionLimits(max_connections=2)) as url:
        port = int(url.rpartition(":")[2])
        held = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
        time.sleep(0.2)  # both accepted before the third comes
        extra = socket.create_connection(("127.0.0.1", port))
        try:
            assert closed_within(extra, TIMEOUT)
        finally:
            for s in (*held, extra):
                s.close()
        time.sleep(0.2)
        with httpx.Client(base_url=url, timeout=TIMEOUT) as http:
            still_serves(http)


def test_session_ids_are_kept_out_of_the_access_log():
    record = logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d',
                               ("127.0.0.1:5", "POST", "/v1/sessions/sess_Ab-3_x9/chat/completions", "1.1", 200),
                               None)
    assert SessionIdFilter().filter(record)
    assert "sess_Ab-3_x9" not in record.getMessage() and "/v1/sessions/" in record.getMessage()
    server_config(None, "127.0.0.1", 0)  # as `astrai-pl serve` builds its server
    assert any(isinstance(f, SessionIdFilter) for f in logging.getLogger("uvicorn.access").filters)
