"""One client cannot exhaust or spy on the others: session turns count their replies against
--max-session-tokens, and cache salts (a request's `cache_salt`, or one per API key) keep other clients'
prompts out of `cached_tokens`, which the server can also leave out altogether."""

import asyncio

import httpx
import pytest
from served import MODEL, TIMEOUT, running

from astrai_pl.inference import Engine
from astrai_pl.model import Transformer
from astrai_pl.serve.sessions_api import SessionStore
from astrai_pl.serve.state import ServerState

SECRET = "The vault PIN is 4711. Never tell anyone the PIN, whatever they say. " * 2


@pytest.fixture(scope="module")
def quiet_engine(model_dir, tokenizer):
    """An engine of its own (no per-step recount): the issue's setting, 256 pages of 16 tokens."""
    return Engine(Transformer.from_pretrained(model_dir).eval(), tokenizer, max_total_tokens=4096)


async def turns_at_once(url: str, count: int, max_tokens: int) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as http:
        ids = [(await http.post("/v1/sessions", json={})).json()["id"] for _ in range(count)]
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens, "ignore_eos": True,
                "temperature": 0}
        return await asyncio.gather(*(http.post(f"/v1/sessions/{sid}/chat/completions", json=body) for sid in ids))


def test_session_turns_reserve_their_replies_and_stateless_requests_keep_their_room(model_dir, tokenizer):
    engine = Engine(Transformer.from_pretrained(model_dir).eval(), tokenizer, max_total_tokens=1024)  # 64 pages
    store = SessionStore(engine, max_tokens=512)  # 32 of them
    state = ServerState(engine, tokenizer, MODEL, sessions=store)
    with running(state) as url:
        answers = asyncio.run(turns_at_once(url, 8, 120))  # 8 turns of 9 pages each would pin 72
        served = [r for r in answers if r.status_code == 200]
        refused = [r for r in answers if r.status_code != 200]
        assert served and refused, [r.status_code for r in answers]
        assert all(r.status_code == 429 and r.json()["error"]["code"] == "session_memory_full" for r in refused)
        assert all(r.json()["usage"]["completion_tokens"] == 120 for r in served)
        assert store.pinned_pages() <= store.max_pages  # what --max-session-tokens says
        with httpx.Client(base_url=url, timeout=TIMEOUT) as http:
            plain = http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 400, "ignore_eos": True})
            assert plain.status_code == 200, plain.text
            sid = http.post("/v1/sessions", json={}).json()["id"]
            left = http.post(f"/v1/sessions/{sid}/chat/completions",  # no max_tokens: what the limit leaves
                             json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": None})
            assert left.status_code in (200, 429), left.text
            assert store.pinned_pages() <= store.max_pages
    store.close_all()
    engine.stop()


def cached(http, headers=None, secret=SECRET, **body) -> int | None:
    r = http.post("/v1/chat/completions", headers=headers or {}, json={
        "messages": [{"role": "system", "content": secret}, {"role": "user", "content": "PIN?"}], "max_tokens": 0,
        **body})
    assert r.status_code == 200, r.text
    details = r.json()["usage"]["prompt_tokens_details"]
    return None if details is None else details["cached_tokens"]


def test_a_cache_salt_keeps_other_clients_prompts_out_of_cached_tokens(quiet_engine, tokenizer):
    quiet_engine.reset_prefix_cache()
    with running(ServerState(quiet_engine, tokenizer, MODEL)) as url, httpx.Client(base_url=url, timeout=TIMEOUT) as h:
        assert cached(h, cache_salt="victim") == 0
        assert cached(h, cache_salt="attacker") == 0  # the same prompt, another salt: nothing to learn
        assert cached(h) == 0  # no salt is a salt of its own
        assert cached(h, cache_salt="victim") > 0  # within one salt the prefix is shared as before
        too_long = h.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "cache_salt": "s" * 300})
        assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "cache_salt"


def test_each_api_key_can_have_a_cache_of_its_own(quiet_engine, tokenizer):
    quiet_engine.reset_prefix_cache()
    state = ServerState(quiet_engine, tokenizer, MODEL, api_key=["victim-key", "attacker-key"], salt_per_key=True)
    victim, attacker = ({"Authorization": f"Bearer {k}-key"} for k in ("victim", "attacker"))
    with running(state) as url, httpx.Client(base_url=url, timeout=TIMEOUT) as h:
        assert cached(h, victim) == 0
        victims_salt = state.check_key(victim["Authorization"])
        assert cached(h, attacker, cache_salt=victims_salt) == 0  # a body's salt cannot name another key's
        assert cached(h, attacker) == 0
        assert cached(h, attacker) > 0 and cached(h, victim) > 0  # within one key the prefix is shared
        other = "Another secret entirely: the launch code is 0815. " * 2  # no page in common with SECRET
        sid = h.post("/v1/sessions", headers=victim, json={"messages": [{"role": "system", "content": other}]})
        assert sid.status_code == 200  # a session's prefixes are its key's too
        assert cached(h, attacker, other) == 0
        assert cached(h, victim, other) > 0


def test_the_server_can_keep_cache_hits_to_itself(quiet_engine, tokenizer):
    state = ServerState(quiet_engine, tokenizer, MODEL, report_cached_tokens=False)
    with running(state) as url, httpx.Client(base_url=url, timeout=TIMEOUT) as h:
        assert cached(h) is None and cached(h) is None
        r = h.post("/v1/completions", json={"prompt": SECRET, "max_tokens": 1, "stream": True,
                                            "stream_options": {"include_usage": True}})
        assert '"prompt_tokens_details": null' in r.text and "cached_tokens" not in r.text
