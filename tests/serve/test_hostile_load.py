"""A hostile client and a normal one on the same server (loopback, bounded counts and time): the hostile one
sends text that cannot fit, a flood of prompts, a log-probability flood, session turns that would pin the
pool, a request that cannot fit beside them, cache probes for the other's prompt and connections that never
finish their headers. Every request of the normal client must succeed with the offline greedy answer, the
hostile client must learn nothing from the cache, and the process's memory must stay under a stated bound."""

import asyncio
import gc
import socket
import threading

import httpx
import pytest
from served import MODEL, TIMEOUT, running
from test_load import rss_bytes

from astrai_pl.commands import chat_ids
from astrai_pl.inference import Engine, SamplingParams
from astrai_pl.model import Transformer
from astrai_pl.serve.connections import ConnectionLimits
from astrai_pl.serve.sessions_api import SessionStore
from astrai_pl.serve.state import ServerState

ATTACK_TIMEOUT_S = 120.0  # the whole exchange; it ends by itself well before
RSS_BOUND = 256 * 2**20  # bytes the process may grow by, at its peak, over its size before the exchange
SYSTEM = "You are the billing assistant of ACME. The customer's PIN is 4711; never reveal it. "
NORMAL = "normal-key"
HOSTILE = "hostile-key"


def normal_requests() -> list[dict]:
    """The normal client's requests: chat with a shared system prompt and plain completions, greedy."""
    out = []
    for i in range(12):
        if i % 2:
            out.append({"chat": True, "messages": [{"role": "system", "content": SYSTEM},
                                                   {"role": "user", "content": f"What do I owe for order {i}?"}]})
        else:
            out.append({"chat": False, "prompt": f"Invoice {i}: the amount due is"})
        out[-1]["max_tokens"] = 6 + i % 5
    return out


def offline(engine, tokenizer, requests) -> list[str]:
    prompts = [chat_ids(tokenizer, q["messages"]) if q["chat"] else tokenizer.encode(q["prompt"]) for q in requests]
    params = [SamplingParams(max_tokens=q["max_tokens"], temperature=0) for q in requests]
    return [c.text for c in engine.generate(prompts, params)]


async def normal_client(http: httpx.AsyncClient, requests) -> list[tuple[int, str]]:
    async def one(q):
        fields = {"model": MODEL, "max_tokens": q["max_tokens"], "temperature": 0}
        if q["chat"]:
            r = await http.post("/v1/chat/completions", json={**fields, "messages": q["messages"]})
            return r.status_code, r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else r.text
        r = await http.post("/v1/completions", json={**fields, "prompt": q["prompt"]})
        return r.status_code, r.json()["choices"][0]["text"] if r.status_code == 200 else r.text

    results = []
    for start in range(0, len(requests), 3):  # three at a time, while the attack goes on
        await asyncio.sleep(0.05)
        results += await asyncio.gather(*(one(q) for q in requests[start:start + 3]))
    return results


async def hostile_client(http: httpx.AsyncClient, port: int) -> dict[str, list[int]]:
    """Each attack's statuses (what the server answered; none may be a 5xx but the 503 of a request that
    cannot fit), and the cached_tokens the probes saw."""
    statuses: dict[str, list[int]] = {}

    async def post(kind: str, path: str, body: dict) -> httpx.Response:
        r = await http.post(path, json={"model": MODEL, **body})
        statuses.setdefault(kind, []).append(r.status_code)
        return r

    slow = [socket.create_connection(("127.0.0.1", port)) for _ in range(16)]
    for s in slow:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and never the rest
    sessions = [(await post("session", "/v1/sessions", {})).json()["id"] for _ in range(8)]
    turn = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 120, "ignore_eos": True}
    probes = [{"messages": [{"role": "system", "content": SYSTEM.replace("4711", f"{pin:04d}")},
                            {"role": "user", "content": "x"}], "max_tokens": 0} for pin in (4711, 1234, 4711)]
    attacks = [
        post("huge prompt", "/v1/completions", {"prompt": "x" * 4 * 2**20, "max_tokens": 1}),
        post("huge chat", "/v1/chat/completions", {"messages": [{"role": "user", "content": "y" * 4 * 2**20}]}),
        post("many prompts", "/v1/completions", {"prompt": ["x"] * 100_000, "max_tokens": 1}),
        post("logprob flood", "/v1/chat/completions", {"messages": turn["messages"], "n": 64, "max_tokens": 480,
                                                        "logprobs": True, "top_logprobs": 20}),
        *(post("turn", f"/v1/sessions/{sid}/chat/completions", turn) for sid in sessions),
        post("cannot fit", "/v1/completions", {"prompt": [[9] * 400], "n": 32, "max_tokens": 100,
                                               "ignore_eos": True}),
    ]
    await asyncio.gather(*attacks)
    cached = [(await post("probe", "/v1/chat/completions", p)).json()["usage"]["prompt_tokens_details"]
              ["cached_tokens"] for p in probes]
    for s in slow:
        s.close()
    return {**statuses, "cached": cached}


class PeakRSS:
    """The process's largest resident size, sampled every 10 ms on a thread until `stop()`."""

    def __init__(self):
        self.peak, self.done = rss_bytes(), threading.Event()
        self.thread = threading.Thread(target=self.watch, daemon=True)
        self.thread.start()

    def watch(self):
        while not self.done.wait(0.01):
            self.peak = max(self.peak, rss_bytes())

    def stop(self) -> int:
        self.done.set()
        self.thread.join()
        return self.peak


@pytest.fixture(scope="module")
def hostile_engine(model_dir, tokenizer):
    """The issue's setting: context 512, 4096 KV tokens (256 pages of 16), no per-step recount."""
    return Engine(Transformer.from_pretrained(model_dir).eval(), tokenizer, max_total_tokens=4096)


def test_a_hostile_client_neither_starves_nor_spies_on_a_normal_one(hostile_engine, tokenizer):
    requests = normal_requests()
    references = offline(hostile_engine, tokenizer, requests)
    hostile_engine.reset_prefix_cache()
    store = SessionStore(hostile_engine, max_tokens=1024)
    state = ServerState(hostile_engine, tokenizer, MODEL, api_key=[NORMAL, HOSTILE], salt_per_key=True,
                        sessions=store)
    with running(state, ConnectionLimits(header_timeout=1.0, max_connections=64)) as url:
        port = int(url.rpartition(":")[2])

        async def exchange():
            async with (httpx.AsyncClient(base_url=url, timeout=TIMEOUT,
                                          headers={"Authorization": f"Bearer {NORMAL}"}) as normal,
                        httpx.AsyncClient(base_url=url, timeout=TIMEOUT,
                                          headers={"Authorization": f"Bearer {HOSTILE}"}) as hostile):
                await normal.post("/v1/chat/completions", json={"messages": requests[1]["messages"], "max_tokens": 1})
                return await asyncio.wait_for(asyncio.gather(normal_client(normal, requests),
                                                             hostile_client(hostile, port)), ATTACK_TIMEOUT_S)

        gc.collect()
        peak = PeakRSS()
        before = peak.peak
        served, attacked = asyncio.run(exchange())
        grown = peak.stop() - before
        print(f"hostile exchange: peak RSS {grown / 2**20:.1f} MiB over {before / 2**20:.1f} MiB; {attacked}")
        store.close_all()
    assert [status for status, _ in served] == [200] * len(requests), served
    assert [text for _, text in served] == references
    assert set(attacked["huge prompt"]) == set(attacked["huge chat"]) == {400}
    assert attacked["many prompts"] == [400] and attacked["logprob flood"] == [400]
    assert set(attacked["turn"]) <= {200, 429} and 429 in attacked["turn"]
    assert attacked["cannot fit"][0] in (200, 503)
    assert attacked["cached"][0] == 0  # the normal client's system prompt, cached under its key: no hit
    assert 0 < attacked["cached"][1] < attacked["cached"][2]  # the hostile client's own probes share prefixes
    assert grown < RSS_BOUND, f"RSS grew by {grown / 2**20:.1f} MiB, over the bound of {RSS_BOUND / 2**20:.0f} MiB"
