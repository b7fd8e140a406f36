"""What a running server owes the engine and its host: a request whose client leaves is aborted and its pages
freed, the queue limit refuses and recovers, /health and /metrics answer, and SIGTERM exits 0."""

import contextlib
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest
from served import MODEL, TIMEOUT, running

from astrai_pl.inference import Engine
from astrai_pl.model import Transformer
from astrai_pl.serve.cli import serve_verb
from astrai_pl.serve.state import ServerState

LONG = {"model": MODEL, "prompt": "Tell me a long story", "max_tokens": 480, "ignore_eos": True, "temperature": 0}
FINISHED_DECODE = LONG["max_tokens"] - 1  # decode tokens a finished LONG computes: its last is never fed back


def wait_until(condition, what: str, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.02)


def idle(engine) -> bool:
    return not engine.has_unfinished() and engine.usage().in_use == 0


def test_a_stream_the_client_leaves_is_aborted_and_its_pages_freed(url, engine, state):
    before = engine.stats.decode_tokens
    with httpx.Client(base_url=url, timeout=TIMEOUT) as http:
        with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
    wait_until(lambda: idle(engine) and state.in_flight == 0, "the engine is idle")
    assert engine.stats.decode_tokens - before < FINISHED_DECODE  # it stopped early: aborted
    assert not state.handles


def test_a_whole_answer_the_client_leaves_is_aborted(url, engine, state):
    before = engine.stats.decode_tokens
    with httpx.Client(base_url=url, timeout=httpx.Timeout(TIMEOUT, read=0.3)) as http:
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/completions", json=LONG)
    wait_until(lambda: idle(engine) and state.in_flight == 0, "the engine is idle")
    assert engine.stats.decode_tokens - before < FINISHED_DECODE


def test_a_full_queue_refuses_with_429_and_serves_once_a_request_ends(engine, tokenizer):
    state = ServerState(engine, tokenizer, MODEL, max_queue=1)
    with running(state) as url, httpx.Client(base_url=url, timeout=TIMEOUT) as http:
        with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as held:
            lines = held.iter_lines()  # kept: a dropped line iterator closes the response
            assert next(lines).startswith("data: ")
            refused = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert refused.status_code == 429
            assert refused.json()["error"]["code"] == "rate_limit_exceeded"
            assert http.get("/v1/models").status_code == 200  # only generation counts
        wait_until(lambda: state.in_flight == 0, "the held stream is released")
        assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
    wait_until(lambda: idle(engine), "the engine is idle")


def test_health_and_metrics_answer(http):
    assert http.get("/health").json() == {"status": "ok"}
    metrics = http.get("/metrics")
    assert metrics.status_code == 200
    assert metrics.headers["content-type"].startswith("text/plain; version=0.0.4")


def test_max_model_len_bounds_prompt_and_completion(engine, tokenizer):
    state = ServerState(engine, tokenizer, MODEL, max_model_len=20)
    with running(state) as url, httpx.Client(base_url=url, timeout=TIMEOUT) as http:
        too_long = http.post("/v1/completions", json={"prompt": "x" * 20})
        assert too_long.status_code == 400 and "20 tokens, the context holds 20" in too_long.json()["error"]["message"]
        out = http.post("/v1/completions", json={"prompt": "x" * 15, "max_tokens": None, "ignore_eos": True}).json()
        assert out["usage"]["completion_tokens"] == 5 and out["choices"][0]["finish_reason"] == "length"


def test_a_missing_model_exits_with_its_message(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit:
        serve_verb(["--model", str(tmp_path / "missing")])
    assert str(exit.value.code).startswith("astrai-pl serve: ") and "missing" in str(exit.value.code)


@contextlib.contextmanager
def serve_process(model_dir, *options):
    """`astrai-pl serve` in a child process on a free port; yields (process, port), kills it if still alive."""
    command = [sys.executable, "-m", "astrai_pl.cli", "serve", "--model", str(model_dir), "--port", "0",
               "--max-total-tokens", "4096", *options]
    server = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        port = None
        deadline = time.monotonic() + 120
        while port is None and time.monotonic() < deadline:
            line = server.stderr.readline()
            assert line, "the server ended before it listened"
            if found := re.search(r"running on http://127\.0\.0\.1:(\d+)", line):
                port = int(found.group(1))
        assert port, "the server did not listen in time"
        yield server, port
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        server.stderr.close()


def stream_through_sigterm(server, port: int, max_tokens: int) -> list[str]:
    """Open a stream, send SIGTERM after its first chunk, and return the lines that came after."""
    body = {"prompt": "Once", "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=TIMEOUT) as stream:
        lines = stream.iter_lines()
        assert next(lines).startswith("data: ")
        server.send_signal(signal.SIGTERM)
        try:
            return [line for line in lines if line]
        except httpx.HTTPError:  # the server closed the connection mid-chunk
            return []


@pytest.mark.slow
def test_sigterm_lets_a_stream_finish_then_exits_0(model_dir):
    with serve_process(model_dir, "--graceful-timeout", "20") as (server, port):
        rest = stream_through_sigterm(server, port, 40)
        assert rest[-1] == "data: [DONE]"  # the request in flight finished within the grace period
        assert '"finish_reason": "length"' in rest[-2]
        assert server.wait(timeout=60) == 0


@pytest.mark.slow
def test_sigterm_aborts_what_outlasts_the_grace_period_and_exits_0(model_dir):
    with serve_process(model_dir, "--graceful-timeout", "0") as (server, port):
        rest = stream_through_sigterm(server, port, 480)
        assert "data: [DONE]" not in rest and len(rest) < 479  # cut off, not finished
        assert server.wait(timeout=60) == 0


def test_health_is_503_while_the_engine_loop_is_stopped(http, engine):
    engine.stop()
    try:
        assert http.get("/health").status_code == 503
    finally:
        engine.start()
    assert http.get("/health").status_code == 200


def test_chat_without_max_tokens_fits_n_samples_in_a_pool_no_larger_than_the_context(model_dir, tokenizer):
    engine = Engine(Transformer.from_pretrained(model_dir).eval(), tokenizer, max_total_tokens=64)
    assert engine.max_context == 64  # the pool holds one context, no more
    with running(ServerState(engine, tokenizer, MODEL)) as url, httpx.Client(base_url=url, timeout=TIMEOUT) as http:
        body = {"messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": None, "temperature": 0}
        out = http.post("/v1/chat/completions", json=body)
        assert out.status_code == 200, out.text
        assert [c["index"] for c in out.json()["choices"]] == [0, 1]
        assert {c["finish_reason"] for c in out.json()["choices"]} == {"length"}
    engine.stop()
