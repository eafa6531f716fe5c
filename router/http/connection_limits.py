"""What keeps the router's HTTP server standing under hostile load: connection and request caps,
read timeouts, and one log line per descriptor-exhaustion event.

```
HttpLimits                    the settings (RouterConfig's --http-* knobs)
LimitedH11Protocol            uvicorn's h11 protocol, plus:
  connection_made               over max_connections: the oldest connection with no request in
                                flight is closed (idle keep-alive, slowloris, a client that never
                                sent a byte); none idle: the new one gets 503 + Retry-After
  header timer                  from the connection's first byte (or the next request's) to its
                                whole header: header_timeout_s, else closed (slowloris)
  body timer                    while a request's body is incomplete, each wait for more of it:
                                body_timeout_s, else closed
RequestLimit (ASGI)           /v1/ requests in flight, streams included: max_requests; beyond,
                              503 + Retry-After in OpenAI's error shape (/health and /metrics
                              are never counted nor refused)
AcceptErrorLog                asyncio's "socket.accept() out of system resource" (EMFILE):
                              one log line per event, not a traceback per failed accept
```

Why eviction, not a second listener for /health: a new connection (a probe's, a client's) is
always served, on the one port every probe and client already uses, while the descriptors
stay bounded (max_connections, below the process's limit). An attacker's idle connections only
push out each other: the oldest goes first and a new client sends its request within
milliseconds. gRPC has its own listener and C-core threads; it needs only descriptors, which
the cap leaves it (router/README.md, "HTTP under load", has the measurements).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1
_OVERLOADED = (
    b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: %d\r\nContent-Type: application/json\r\n"
    b"Content-Length: %d\r\nConnection: close\r\n\r\n%s"
)
_ACCEPT_FAILED = "socket.accept() out of system resource"
_ACCEPT_LOG_EVERY_S = 60.0


@dataclass(frozen=True)
class HttpLimits:
    max_connections: int = 2048
    max_requests: int = 512
    header_timeout_s: float = 15.0
    body_timeout_s: float = 15.0
    keep_alive_s: float = 5.0


def overloaded_body(message: str) -> bytes:
    error = {"message": message, "type": "service_unavailable_error", "param": None,
             "code": "overloaded"}  # fmt: skip
    return json.dumps({"error": error}).encode()


class LimitedH11Protocol(H11Protocol):
    """One HTTP/1.1 connection (uvicorn's), with the caps and timers above. `limits` is set
    on a subclass per server (`protocol_class`)."""

    limits = HttpLimits()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._since = time.monotonic()
        self._timer: asyncio.TimerHandle | None = None
        if len(self.connections) > self.limits.max_connections and not self._evict_one():
            body = overloaded_body("too many connections: retry later")
            transport.write(_OVERLOADED % (RETRY_AFTER_S, len(body), body))
            transport.close()
            return
        self._arm(self.limits.header_timeout_s)

    def _evict_one(self) -> bool:
        """Close the oldest connection with no request in flight (not this one)."""
        idle = [
            c for c in self.connections
            if c is not self and isinstance(c, LimitedH11Protocol) and not c.busy
            and not c.transport.is_closing()
        ]  # fmt: skip
        if not idle:
            return False
        oldest = min(idle, key=lambda c: c._since)
        logger.debug("over %d HTTP connections: closing an idle one", self.limits.max_connections)
        oldest.transport.close()
        self.connections.discard(oldest)
        return True

    @property
    def busy(self) -> bool:
        """A request is in flight (its headers arrived, its response is not done)."""
        return self.cycle is not None and not self.cycle.response_complete

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.transport.is_closing():
            return
        if not self.busy:
            if self._timer is None:  # the first byte of a request: its header timer
                self._arm(self.limits.header_timeout_s)
        elif self.cycle.more_body:
            self._arm(self.limits.body_timeout_s)  # more of the body came: wait again
        else:
            self._disarm()  # the whole request is in

    def handle_events(self) -> None:
        was_busy = self.busy
        super().handle_events()
        if self.busy and not was_busy:  # a request's headers are in: no header timer
            self._disarm()
            if self.cycle.more_body:
                self._arm(self.limits.body_timeout_s)

    def on_response_complete(self) -> None:
        self._disarm()  # uvicorn's keep-alive timer takes over
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self, timeout_s: float) -> None:
        self._disarm()
        self._timer = self.loop.call_later(timeout_s, self._timed_out)

    def _disarm(self) -> None:
        timer = getattr(self, "_timer", None)
        if timer is not None:
            timer.cancel()
            self._timer = None

    def _timed_out(self) -> None:
        self._timer = None
        if self.busy and not self.cycle.more_body:
            return  # the request is in; the response is the app's business
        logger.debug("HTTP connection from %s too slow to send its request: closed", self.client)
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True
            self.cycle.message_event.set()
        self.transport.close()


def protocol_class(limits: HttpLimits) -> type[LimitedH11Protocol]:
    return type("LimitedH11", (LimitedH11Protocol,), {"limits": limits})


class RequestLimit:
    """ASGI middleware: at most `max_requests` /v1/ requests in flight (streams included)."""

    def __init__(self, app: Any, max_requests: int) -> None:
        self.app = app
        self.max_requests = max_requests
        self.in_flight = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        if self.in_flight >= self.max_requests:
            await _send_overloaded(send, self.max_requests)
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1


async def _send_overloaded(send: Any, max_requests: int) -> None:
    body = overloaded_body(
        f"this router runs {max_requests} HTTP requests at once (--http-max-requests); "
        f"retry in about {RETRY_AFTER_S} s"
    )
    headers = [(b"content-type", b"application/json"), (b"retry-after", b"%d" % RETRY_AFTER_S),
               (b"content-length", b"%d" % len(body))]  # fmt: skip
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class AcceptErrorLog:
    """A loop exception handler: asyncio's failed accepts (out of descriptors) as one warning
    per event (and one a minute while it lasts, with the count), everything else as before."""

    def __init__(self, previous: Any) -> None:
        self.previous = previous
        self._last_log_s = -_ACCEPT_LOG_EVERY_S
        self.num_failures = 0

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if context.get("message") != _ACCEPT_FAILED:
            if self.previous is not None:
                self.previous(loop, context)
            else:
                loop.default_exception_handler(context)
            return
        self.num_failures += 1
        now = time.monotonic()
        if now - self._last_log_s >= _ACCEPT_LOG_EVERY_S:
            logger.warning(
                "cannot accept HTTP connections: %s (%d failed accepts so far; new "
                "connections wait in the backlog; see --http-max-connections)",
                context.get("exception"), self.num_failures,
            )  # fmt: skip
            self._last_log_s = now
