"""A served debug model (test_commands' chatty one: greedy replies in printable ASCII) behind uvicorn on a free
loopback port, and clients for it."""

import httpx
import openai
import pytest
import test_commands
from served import MODEL, TIMEOUT, running

from astrai_pl.serve.state import ServerState

# test_commands' fixtures: the byte tokenizer, the chatty model saved with it, and an engine on that directory
tokenizer, model_dir, engine = test_commands.tokenizer, test_commands.model_dir, test_commands.engine


@pytest.fixture(scope="module")
def state(engine, tokenizer):
    return ServerState(engine, tokenizer, MODEL)


@pytest.fixture(scope="module")
def url(state):
    with running(state) as base:
        yield base


@pytest.fixture
def client(url):
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=TIMEOUT, max_retries=0) as c:
        yield c


@pytest.fixture
def async_client(url):
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", timeout=TIMEOUT, max_retries=0)


@pytest.fixture
def http(url):
    with httpx.Client(base_url=url, timeout=TIMEOUT) as c:
        yield c
