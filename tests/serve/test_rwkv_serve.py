"""`astrai-pl serve` on an RWKV checkpoint: the engine, session store and state the verb builds, behind uvicorn;
the openai client's greedy completions and chat answers equal the engine's own."""

import httpx
import openai
import pytest
import test_cli_rwkv
from served import TIMEOUT, running

from astrai_pl.commands import chat_ids, load_engine
from astrai_pl.inference import SamplingParams
from astrai_pl.serve.cli import serve_parser
from astrai_pl.serve.sessions_api import SessionStore
from astrai_pl.serve.state import ServerState

tokenizer, rwkv_dir = test_cli_rwkv.tokenizer, test_cli_rwkv.rwkv_dir


@pytest.fixture(scope="module")
def served(rwkv_dir):
    """(engine, base URL) as `astrai-pl serve --model DIR` builds them."""
    ns = serve_parser().parse_args(["--model", str(rwkv_dir), "--max-total-tokens", "4096"])
    engine, tok, eos_ids = load_engine(ns)
    state = ServerState(engine, tok, "rwkv", stop_token_ids=eos_ids, sessions=SessionStore(engine))
    with running(state) as url:
        yield engine, url


@pytest.fixture
def client(served):
    with openai.OpenAI(base_url=f"{served[1]}/v1", api_key="unused", timeout=TIMEOUT, max_retries=0) as c:
        yield c


def test_completions_and_chat_equal_the_engine(served, client, tokenizer):
    engine = served[0]
    got = client.completions.create(model="rwkv", prompt="Once upon a time", max_tokens=8, temperature=0)
    [want] = engine.generate("Once upon a time", SamplingParams(max_tokens=8, temperature=0))
    assert got.choices[0].text == want.text and got.usage.completion_tokens == 8
    user = [{"role": "user", "content": "What is 2 + 3?"}]
    answer = client.chat.completions.create(model="rwkv", messages=user, max_tokens=8, temperature=0)
    [want] = engine.generate(chat_ids(tokenizer, user), SamplingParams(max_tokens=8, temperature=0))
    assert answer.choices[0].message.content == want.text
    again = client.completions.create(model="rwkv", prompt="Once upon a time", max_tokens=8, temperature=0)
    assert again.choices[0].text == got.choices[0].text


def test_a_session_turn_answers_like_stateless_chat_and_holds_one_state(served):
    engine, url = served
    with httpx.Client(base_url=url, timeout=TIMEOUT) as http:
        made = http.post("/v1/sessions", json={"messages": [{"role": "system", "content": "Be brief."}]})
        assert made.status_code == 200, made.text
        sid = made.json()["id"]
        messages = [{"role": "user", "content": "Hi!"}]
        greedy = {"max_tokens": 8, "temperature": 0}
        answer = http.post(f"/v1/sessions/{sid}/chat/completions", json={"messages": messages, **greedy})
        assert answer.status_code == 200, answer.text
        whole = [{"role": "system", "content": "Be brief."}, *messages]
        stateless = http.post("/v1/chat/completions", json={"model": "rwkv", "messages": whole, **greedy})
        assert answer.json()["choices"][0]["message"] == stateless.json()["choices"][0]["message"]
        described = http.get(f"/v1/sessions/{sid}").json()
        assert described["pages"] == 1 and described["bytes"] == engine.usage().state_bytes
        assert http.delete(f"/v1/sessions/{sid}").status_code == 200
