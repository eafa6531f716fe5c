"""HttpServer: uvicorn serving the router's FastAPI app inside the router's event loop.

```
start():  bind HOST:PORT ourselves (OSError when taken; port 0: a free one) -> uvicorn serves
          the socket in a task of this loop (no signal handlers of its own: the launcher's
          pdserve.lifecycle keeps SIGINT/SIGTERM), within HttpLimits (connection_limits.py:
          connection and request caps, header/body/keep-alive timeouts, one log line per
          descriptor-exhaustion event)
stop():   stop accepting; open connections get grace_s, then their tasks are cancelled
```
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import resource
import socket
from collections.abc import Callable, Iterator

import uvicorn
from fastapi import FastAPI

from pdserve.config import RouterConfig
from pdserve.net import host_port
from router.auth import ApiKeys
from router.http.app import build_app
from router.http.connection_limits import (
    AcceptErrorLog,
    HttpLimits,
    RequestLimit,
    protocol_class,
)
from router.http.openai_serving import OpenAIServing
from router.metrics import RouterMetrics
from router.request_handler import RequestHandler

logger = logging.getLogger(__name__)

_START_TIMEOUT_S = 10.0
DESCRIPTOR_RESERVE = 256  # descriptors HTTP connections never take (gRPC, node channels, files)


class _EmbeddedServer(uvicorn.Server):
    """uvicorn without its signal handling (the launcher owns the signals)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HttpServer:
    def __init__(
        self, app: FastAPI, host: str, port: int, grace_s: float, limits: HttpLimits | None = None
    ) -> None:
        self._host = host
        self.port = port
        self.limits = limits = _within_descriptors(limits or HttpLimits())
        self.request_limit = RequestLimit(app, limits.max_requests)
        config = uvicorn.Config(
            self.request_limit, log_config=None, access_log=False, lifespan="off",
            http=protocol_class(limits),
            # seconds, fractions too (uvicorn passes them to asyncio; it annotates int)
            timeout_graceful_shutdown=max(grace_s, 0.1),  # type: ignore[arg-type]
            timeout_keep_alive=limits.keep_alive_s,  # type: ignore[arg-type]
        )  # fmt: skip
        self._server = _EmbeddedServer(config)
        self._task: asyncio.Task[None] | None = None
        self._accept_log: AcceptErrorLog | None = None

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self._host in ("0.0.0.0", "") else self._host
        host = "::1" if host == "::" else host
        return f"http://{host_port(host, self.port)}"

    async def start(self) -> int:
        """Serves; returns the bound port. Raises OSError when the address cannot be bound."""
        sock = _bind(self._host, self.port)
        self.port = sock.getsockname()[1]
        loop = asyncio.get_running_loop()
        self._accept_log = AcceptErrorLog(loop.get_exception_handler())
        loop.set_exception_handler(self._accept_log)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="http")
        async with asyncio.timeout(_START_TIMEOUT_S):
            while not self._server.started:
                if self._task.done():
                    self._task.result()  # raises what failed
                    raise OSError(f"HTTP server on {self.url} stopped while starting")
                await asyncio.sleep(0.01)
        return self.port

    async def stop(self) -> None:
        if self._task is None:
            return
        self._server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError, SystemExit):
            await self._task
        self._task = None
        loop = asyncio.get_running_loop()
        if self._accept_log is not None and loop.get_exception_handler() is self._accept_log:
            loop.set_exception_handler(self._accept_log.previous)


def router_http_server(
    config: RouterConfig,
    handler: RequestHandler,
    metrics: RouterMetrics,
    is_ready: Callable[[], bool],
    api_keys: ApiKeys | None,
) -> HttpServer:
    """The router's HTTP server: its app over `handler`, within the config's --http-* limits."""
    app = build_app(OpenAIServing(handler), metrics, is_ready, config.max_request_bytes,
                    api_keys, config.max_choices_per_request)  # fmt: skip
    limits = HttpLimits(
        config.http_max_connections, config.http_max_requests, config.http_header_timeout_s,
        config.http_body_timeout_s, config.http_keep_alive_s,
    )  # fmt: skip
    return HttpServer(app, config.host, config.http_port, config.grace_s, limits)


def _within_descriptors(limits: HttpLimits) -> HttpLimits:
    """`limits` with max_connections below the process's descriptor limit, DESCRIPTOR_RESERVE
    left for gRPC, node channels and files (logged when lowered)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return limits
    room = max(soft - DESCRIPTOR_RESERVE, 16)
    if limits.max_connections <= room:
        return limits
    logger.warning(
        "--http-max-connections %d lowered to %d: this process may open %d files "
        "(ulimit -n), %d of them kept for gRPC and the nodes",
        limits.max_connections, room, soft, DESCRIPTOR_RESERVE,
    )  # fmt: skip
    return dataclasses.replace(limits, max_connections=room)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto named: asyncio sets TCP_NODELAY only on sockets whose proto is IPPROTO_TCP (0 is
    # not), and without it a keep-alive response's body waits for the ACK of its headers: the
    # client's delayed ACK, 40 ms a request (measured: pd-bench router, HTTP p50 52 -> 5 ms)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise OSError(f"cannot listen for HTTP on {host_port(host, port)}: {error}") from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock
