"""Ports for tests that must name one before a server binds it, without a race.

A port found free now may be taken by another process (a parallel test worker, another
checkout's run) before the server binds it. Where the server can bind port 0 and report what
it got, tests do that. Where it cannot (pd-serve's --http-port and --metrics-port, where 0
means off; a restart on the same ports), the start is retried with fresh ports when, and only
when, it failed because a port was taken:

    router = start_on_free_ports(lambda: start_router(http_port=free_port()))

`free_port()` alone is right only where nothing must bind the port; where nothing may listen on
it (a refused connection), hold `unlistened_port()`'s socket while the test connects.
"""

from __future__ import annotations

import errno
import re
import socket
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

T = TypeVar("T")
START_ATTEMPTS = 5
FIND_ATTEMPTS = 50
# How a start that lost its port says so: the OS's text (Linux, in an OSError or a child's
# log) or pd-serve's own (`pdserve.port_reservations.PortTaken`).
_TAKEN = re.compile(r"address already in use|\bis taken \(")


def free_port() -> int:
    """A loopback port free right now (see the module's note on when that is enough)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def free_ports(count: int) -> int:
    """The first of `count` consecutive loopback ports free right now (pd-serve gives node i of
    `--metrics-port N` the port N + i)."""
    for _ in range(FIND_ATTEMPTS):
        first = free_port()
        if first + count > 65536:
            continue
        sockets: list[socket.socket] = []
        try:
            for port in range(first, first + count):
                sockets.append(socket.socket())
                sockets[-1].bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise RuntimeError(f"no {count} consecutive free ports found")


@contextmanager
def unlistened_port() -> Iterator[int]:
    """A loopback port that refuses connections for as long as the block runs: bound (so no
    other process can take it) and not listening."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield int(sock.getsockname()[1])


def port_was_taken(error: BaseException) -> bool:
    """Whether `error` (an OSError, or a start's error carrying its log) says a port was
    taken."""
    if isinstance(error, OSError) and error.errno == errno.EADDRINUSE:
        return True
    return _TAKEN.search(str(error).lower()) is not None


def start_on_free_ports(start: Callable[[], T], attempts: int = START_ATTEMPTS) -> T:
    """`start()` (which picks its ports afresh on every call), again while it fails because
    a port was taken; any other failure, or the last attempt's, is raised."""
    for _ in range(attempts - 1):
        try:
            return start()
        except Exception as error:
            if not port_was_taken(error):
                raise
    return start()


async def start_on_free_ports_async(
    start: Callable[[], Awaitable[T]], attempts: int = START_ATTEMPTS
) -> T:
    """`start_on_free_ports` for a coroutine."""
    for _ in range(attempts - 1):
        try:
            return await start()
        except Exception as error:
            if not port_was_taken(error):
                raise
    return await start()
