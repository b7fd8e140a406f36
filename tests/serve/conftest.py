"""A served debug model (test_commands' chatty one: greedy replies in printable ASCII) and uvicorn servers on
free loopback ports in threads."""

import contextlib
import threading
import time

import httpx
import openai
import pytest
import test_commands
import uvicorn

from astrai_pl.serve.app import create_app
from astrai_pl.serve.state import ServerState

MODEL = "debug-chat"
TIMEOUT = 30.0  # seconds any one client call may take

# test_commands' fixtures: the byte tokenizer, the chatty model saved with it, and an engine on that directory
tokenizer, model_dir, engine = test_commands.tokenizer, test_commands.model_dir, test_commands.engine


@contextlib.contextmanager
def running(state: ServerState):
    """create_app(state) served by uvicorn on a free 127.0.0.1 port in a thread; yields the base URL."""
    server = uvicorn.Server(uvicorn.Config(create_app(state), host="127.0.0.1", port=0, log_level="warning",
                                           lifespan="off", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + TIMEOUT
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(TIMEOUT)


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
