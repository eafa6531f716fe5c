"""HttpServer: uvicorn serving the router's FastAPI app inside the router's event loop.

```
start():  bind HOST:PORT ourselves (OSError when taken; port 0: a free one) -> uvicorn serves
          the socket in a task of this loop (no signal handlers of its own: the launcher's
          pdserve.lifecycle keeps SIGINT/SIGTERM)
stop():   stop accepting; open connections get grace_s, then their tasks are cancelled
```
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI

from pdserve.net import host_port

logger = logging.getLogger(__name__)

_START_TIMEOUT_S = 10.0


class _EmbeddedServer(uvicorn.Server):
    """uvicorn without its signal handling (the launcher owns the signals)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HttpServer:
    def __init__(self, app: FastAPI, host: str, port: int, grace_s: float) -> None:
        self._host = host
        self.port = port
        config = uvicorn.Config(
            app, log_config=None, access_log=False, lifespan="off",
            # seconds, fractions too (uvicorn passes it to asyncio.timeout; it annotates int)
            timeout_graceful_shutdown=max(grace_s, 0.1),  # type: ignore[arg-type]
            timeout_keep_alive=5,
        )  # fmt: skip
        self._server = _EmbeddedServer(config)
        self._task: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self._host in ("0.0.0.0", "") else self._host
        host = "::1" if host == "::" else host
        return f"http://{host_port(host, self.port)}"

    async def start(self) -> int:
        """Serves; returns the bound port. Raises OSError when the address cannot be bound."""
        sock = _bind(self._host, self.port)
        self.port = sock.getsockname()[1]
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


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise OSError(f"cannot listen for HTTP on {host_port(host, port)}: {error}") from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock
