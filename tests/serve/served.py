"""What the server tests share besides fixtures: the served model's name, the client timeout, and uvicorn
servers on free loopback ports in threads. (A module of its own: `from conftest import` would find whichever
test folder's conftest was imported first.)"""

import contextlib
import threading
import time

import uvicorn

from astrai_pl.serve.app import create_app
from astrai_pl.serve.connections import ConnectionLimits, server_config
from astrai_pl.serve.state import ServerState

MODEL = "debug-chat"
TIMEOUT = 30.0  # seconds any one client call may take


@contextlib.contextmanager
def running(state: ServerState, limits: ConnectionLimits | None = None):
    """create_app(state) served by uvicorn on a free 127.0.0.1 port in a thread, as `astrai-pl serve` serves it
    (`limits`: its connection limits); yields the base URL."""
    server = uvicorn.Server(server_config(create_app(state), "127.0.0.1", 0, limits, log_level="warning",
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

