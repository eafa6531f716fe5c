"""The one polling wait the in-process tests share: poll a predicate until it holds, bounded."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

POLL_S = 0.005


async def wait_until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Poll until `predicate()` holds; raise TimeoutError after `timeout_s`."""
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(POLL_S)
