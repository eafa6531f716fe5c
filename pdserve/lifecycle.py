"""The launchers' signal loop, shared by the router and both node roles.

```
serve_until_signalled(start, ready_line):
    start() ──► print ready_line(server) (flushed: pd-serve and tests read it)
    SIGINT / SIGTERM (also while starting) ──► server.stop() ──► return
    the server's `failed` event (a node that cannot go on) ──► server.stop() ──► ServerFailed
run_server(name, start, ready_line, event_loop="asyncio") -> exit code: the above in a new
    event loop (asyncio's, or uvloop's: event_loop="uvloop"), and
    "NAME: <error>" on stderr with exit code 1 when the server cannot start; first, the
    open-file soft limit raised to the hard one (raise_fd_limit: a router's 1,024 default
    was what 1,100 idle HTTP connections exhausted)
```
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import signal
import sys
from collections.abc import Callable, Coroutine
from typing import Any, Protocol, TypeVar

logger = logging.getLogger(__name__)


class ServerFailed(RuntimeError):
    """The server stopped itself: it cannot go on (e.g. a node's tensor-parallel rank died)."""


class RunningServer(Protocol):
    """What `serve_until_signalled` runs: a router or a node."""

    async def stop(self) -> None: ...


S = TypeVar("S", bound=RunningServer)


async def serve_until_signalled(
    start: Callable[[], Coroutine[Any, Any, S]], ready_line: Callable[[S], str]
) -> None:
    """Start a server, print `ready_line(server)` once it serves, and stop it gracefully on
    SIGINT or SIGTERM (also one that arrives while it is starting)."""
    stop_requested = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop_requested.set)
    starting = asyncio.create_task(start())
    stopping = asyncio.create_task(stop_requested.wait())
    server: S | None = None
    try:
        await asyncio.wait((starting, stopping), return_when=asyncio.FIRST_COMPLETED)
        if starting.done():
            server = starting.result()  # raises what start() raised
            print(ready_line(server), flush=True)
            failed = getattr(server, "failed", None)  # a node that cannot go on stops itself
            if isinstance(failed, asyncio.Event):
                stopping_itself = asyncio.create_task(failed.wait())
                await asyncio.wait((stopping, stopping_itself), return_when=asyncio.FIRST_COMPLETED)
                stopping_itself.cancel()
                if failed.is_set():
                    raise ServerFailed(getattr(server, "failure", None) or "the server failed")
            else:
                await stopping
        logger.info("stopping")
    finally:
        stopping.cancel()
        if not starting.done():  # a signal while starting: let it clean up after itself
            starting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await starting
        if server is not None:
            await server.stop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)


EVENT_LOOPS = ("asyncio", "uvloop")


def run_server(
    name: str,
    start: Callable[[], Coroutine[Any, Any, S]],
    ready_line: Callable[[S], str],
    event_loop: str = "asyncio",
) -> int:
    """`serve_until_signalled` in a new event loop (`event_loop`: one of EVENT_LOOPS); the exit
    code (1, with a message on stderr, when the server cannot start: a taken port, a bad
    model, ...)."""
    raise_fd_limit()
    try:
        with asyncio.Runner(loop_factory=_loop_factory(event_loop)) as runner:
            runner.run(serve_until_signalled(start, ready_line))
    except (OSError, ValueError, ServerFailed) as error:
        print(f"{name}: {error}", file=sys.stderr)
        return 1
    return 0


def _loop_factory(event_loop: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """asyncio's default (None) or uvloop's; ValueError for another name."""
    if event_loop == "asyncio":
        return None
    if event_loop != "uvloop":
        raise ValueError(f"event loop {event_loop!r}: choose one of {', '.join(EVENT_LOOPS)}")
    import uvloop  # (optional: only who asks for it needs it installed)

    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def raise_fd_limit() -> int:
    """Raise this process's open-file soft limit to its hard limit; returns the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as error:  # e.g. an unlimited hard limit macOS refuses
            logger.warning("could not raise the open-file limit from %d: %s", soft, error)
            return soft
        logger.info("open-file limit raised from %d to %d", soft, hard)
        return hard
    return soft
