"""What a client may hold of the server's connections: a cap on open connections, a time limit on sending a
request's headers, a keep-alive limit between requests, and an access log without session ids.

    config = server_config(create_app(state), host, port, ConnectionLimits(max_connections=512))
    uvicorn.Server(config).run()

uvicorn's HTTP/1.1 protocol (h11) waits for a request's headers as long as the client keeps the connection
open, and accepts every connection: 200 clients sending half a header each would hold 200 connections for
ever. `GuardedH11Protocol` closes a connection whose headers are not complete `header_timeout` seconds after
it opened (or after its last response), and one over `max_connections` as soon as it opens.
"""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

SESSION_ID = re.compile(r"sess_[A-Za-z0-9_-]+")
REDACTED = "sess_[redacted]"
MAX_HEADER_BYTES = 64 * 1024  # a request line and headers longer than this are refused (h11's limit)


@dataclass(frozen=True)
class ConnectionLimits:
    """max_connections: open at once (more are closed as they open). header_timeout: seconds a client has to
    send a request's headers. keep_alive_timeout: seconds an idle connection stays open between requests."""

    max_connections: int = 1024
    header_timeout: float = 10.0
    keep_alive_timeout: int = 5

    def __post_init__(self) -> None:
        if self.max_connections < 1 or self.header_timeout <= 0 or self.keep_alive_timeout < 1:
            raise ValueError(f"{self}: allow at least one connection, a positive header timeout and a keep-alive "
                             "of at least 1 s (--max-connections, --header-timeout, --keep-alive-timeout)")


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a connection cap and a header timeout (`limits`, set by `guarded_protocol`)."""

    limits = ConnectionLimits()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.header_deadline: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            self.logger.warning("%d connections are open, the server keeps at most %d (--max-connections); "
                                "closed a new one", len(self.connections) - 1, self.limits.max_connections)
            transport.close()
            return
        self._await_headers()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self._await_headers()  # still no whole request: the deadline set when it began stands
        else:
            self._stop_waiting()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # uvicorn's keep-alive timer covers the idle time from here
        self._stop_waiting()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_waiting()
        super().connection_lost(exc)

    def _await_headers(self) -> None:
        if self.header_deadline is None:
            self.header_deadline = self.loop.call_later(self.limits.header_timeout, self._headers_late)

    def _stop_waiting(self) -> None:
        if self.header_deadline is not None:
            self.header_deadline.cancel()
            self.header_deadline = None

    def _headers_late(self) -> None:
        self.header_deadline = None
        if self.conn.their_state is h11.IDLE and (self.cycle is None or self.cycle.response_complete):
            self.transport.close()


def guarded_protocol(limits: ConnectionLimits) -> type[GuardedH11Protocol]:
    """The protocol class uvicorn builds per connection, bound to `limits`."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"limits": limits})


class SessionIdFilter(logging.Filter):
    """Replaces session ids (bearer tokens of their conversations) in access-log lines."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(SESSION_ID.sub(REDACTED, a) if isinstance(a, str) else a for a in record.args)
        if isinstance(record.msg, str):
            record.msg = SESSION_ID.sub(REDACTED, record.msg)
        return True


def redact_access_log() -> None:
    """Keep session ids out of uvicorn's access log (idempotent)."""
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, SessionIdFilter) for f in access.filters):
        access.addFilter(SessionIdFilter())


def server_config(app, host: str, port: int, limits: ConnectionLimits | None = None, **options) -> uvicorn.Config:
    """uvicorn's config for `app` with `limits` (defaults: ConnectionLimits()) and the access log redacted."""
    limits = limits or ConnectionLimits()
    config = uvicorn.Config(app, host=host, port=port, http=guarded_protocol(limits),
                            timeout_keep_alive=limits.keep_alive_timeout, h11_max_incomplete_event_size=MAX_HEADER_BYTES,
                            **options)
    redact_access_log()  # after the config set logging up
    return config
