"""Test-only access to an `AsyncEngine`'s thread, for tests that force an order on a race:
park the engine thread, count what waits for it, run a probe on it. Nodes never use these
(they call `AsyncEngine`'s typed methods); nothing outside tests/ imports this module.

    release = await hold_engine_thread(engine)    the thread sits in a command until set()
    num_queued_commands(engine)                   commands queued behind it
    await on_engine_thread(engine, fn)            fn(core) on the thread, in command order
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from engine.async_engine import AsyncEngine
from engine.engine_core import EngineCore

T = TypeVar("T")

HOLD_TIMEOUT_S = 60.0  # a held thread lets go after this even if the test never releases it


async def hold_engine_thread(
    engine: AsyncEngine, timeout_s: float = HOLD_TIMEOUT_S
) -> threading.Event:
    """Park the engine thread inside a command (between steps) until the returned event is
    set, or `timeout_s`; returns once it is parked."""
    entered, release = threading.Event(), threading.Event()

    def hold() -> None:
        entered.set()
        release.wait(timeout_s)

    engine._thread.submit(hold, None)
    if not await asyncio.to_thread(entered.wait, timeout_s):
        raise TimeoutError(f"the engine thread did not reach the hold within {timeout_s} s")
    return release


def num_queued_commands(engine: AsyncEngine) -> int:
    return engine._thread.num_queued


def on_engine_thread(engine: AsyncEngine, fn: Callable[[EngineCore], T]) -> asyncio.Future[T]:
    """Queue `fn(core)` now (in order with the engine's other commands); await the returned
    future for its result."""
    future: asyncio.Future[T] = engine._thread.loop().create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    engine._thread.submit(lambda: fn(engine.core), settle)
    return future
