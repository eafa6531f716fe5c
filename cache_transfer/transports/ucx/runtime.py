"""`UcxRuntime`: the process's one UCX context (ucxx keeps one), bound to one event loop.

ucxx's progress thread and the notifier thread that completes its request futures serve the
event loop that was running when the context started. So:

    acquire(transport)   the first UcxTransport of a loop starts UCX for that loop
    release(transport)   the last one closed stops UCX (its threads end), so another event
                         loop (the next test, a restarted server) can start it afresh

Transports on two live event loops at once in one process are refused with a clear error.
Importing this module sets defaults for UCX and ucxx (below) unless the environment sets them.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

_UCX_ENV_DEFAULTS = {
    # ucxx sets UCX_MEMTYPE_CACHE, which UCX >= 1.19 no longer reads and would warn about.
    "UCX_WARN_UNUSED_ENV_VARS": "n",
    # Complete requests through futures (ucxx's notifier thread). Without it ucxx polls every
    # pending request with asyncio.sleep(0): each idle connection, always waiting for its next
    # message, keeps the event loop at 100% CPU.
    "UCXPY_ENABLE_PYTHON_FUTURE": "1",
    # 1 MiB tcp segments instead of 8 KiB: 2-4x the throughput for MiB-sized layers.
    "UCX_TCP_TX_SEG_SIZE": "1m",
    "UCX_TCP_RX_SEG_SIZE": "1m",
    # SO_REUSEADDR on the listener (as gRPC and zmq set it): a node restarted on its old port
    # right after kill -9 binds at once instead of failing "Address already in use" for the
    # minute the dead node's connections spend in TIME_WAIT. Linux still refuses the port
    # while another socket listens on it.
    "UCX_CM_REUSEADDR": "y",
}
for _name, _value in _UCX_ENV_DEFAULTS.items():
    os.environ.setdefault(_name, _value)

import ucxx  # noqa: E402  (the other ucx modules import it from here, after the defaults)
from ucxx.exceptions import UCXCloseError, UCXError, UCXMessageTruncatedError  # noqa: E402

logger = logging.getLogger(__name__)


class UcxRuntime:
    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._users: set[Any] = set()  # open transports

    def acquire(self, user: object) -> None:
        """Start UCX for the running event loop if needed; `user` holds it until released."""
        loop = asyncio.get_running_loop()
        if self._loop is not None and self._loop is not loop:
            if self._users and not self._loop.is_closed():
                raise RuntimeError(
                    f"UCX serves another event loop in this process ({len(self._users)} ucx "
                    "transport(s) open there); close them before using ucx on this loop"
                )
            self._users.clear()  # their loop is gone, and so are they
            self._stop()
        if self._loop is None:
            if ucxx.core._ctx is None:
                ucxx.init()  # settings from the environment (defaults above)
            self._loop = loop
        self._users.add(user)

    def forget(self, user: object) -> None:
        """`user` never got going (its constructor failed)."""
        self._users.discard(user)

    async def release(self, user: object) -> None:
        """`user` closed; stop UCX once nothing holds it."""
        self._users.discard(user)
        if self._users or self._loop is None:
            return
        await asyncio.sleep(0)  # ucxx's listener handlers finish unwinding
        if not self._users:  # nobody acquired it meanwhile
            self._stop()

    def _stop(self) -> None:
        self._loop = None
        _wake_notifier()
        try:
            ucxx.reset()
        except UCXError as error:  # something still holds the old context: it lingers
            logger.warning("ucx did not shut down cleanly: %s", error)


def _wake_notifier() -> None:
    """End ucxx's notifier thread now rather than after its 1 s poll (private ucxx state; a
    function of its own so no reference to the context outlives it)."""
    ctx = ucxx.core._ctx
    if ctx is not None and ctx.worker.enable_python_future:
        ctx.worker.stop_request_notifier_thread()


RUNTIME = UcxRuntime()

__all__ = [
    "RUNTIME",
    "UCXCloseError",
    "UCXError",
    "UCXMessageTruncatedError",
    "UcxRuntime",
    "ucxx",
]
