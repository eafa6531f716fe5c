"""An engine step longer than any timeout, in a test that takes seconds (issue 39 item 8: an
8,100-token prompt with chunked prefill off kept a node's engine in one step for ~51 s).

    held = HeldStep(server, "long")     the step that has request "long" parks the engine thread
    await held.entered()                ... it is parked: every engine call now waits for it
    jump_loop_clock()                   the event loop's clock jumps CLOCK_JUMP_S ahead: every
                                        loop timer due before then (asyncio.timeout,
                                        call_later) fires at its next turn, as if the step
                                        had run that long
    held.release()                      the step runs

A test must leave no loop-timed wait of its own pending across a jump (`asyncio.wait_for`,
`wait_until`, `node_harness.run`'s bound: run it with `asyncio.run`, pytest's timeout bounds
it): gRPC deadlines are real time and are fine. Used by tests/unit/prefill_node and
tests/unit/decode_node.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

HOLD_S = 60.0  # real seconds: the most a step stays parked if a test never releases it
# Beyond every fixed timeout a node had on an engine call (AsyncEngine.call waited 30 s), and
# below the transfer timeouts the tests set (600 s).
CLOCK_JUMP_S = 120.0


class HeldStep:
    """Parks `server`'s engine thread in `EngineCore.step` once its scheduler holds
    `request_id`, until `release()` (or HOLD_S)."""

    def __init__(self, server: Any, request_id: str) -> None:
        self._entered = threading.Event()
        self._released = threading.Event()
        core = server.core
        step = core.step

        def held_step() -> Any:  # engine thread
            if not self._entered.is_set() and core.get_request(request_id) is not None:
                self._entered.set()
                self._released.wait(HOLD_S)
            return step()

        core.step = held_step

    async def entered(self) -> None:
        assert await asyncio.to_thread(self._entered.wait, HOLD_S), "the step never started"

    def release(self) -> None:
        self._released.set()


def jump_loop_clock(seconds: float = CLOCK_JUMP_S) -> None:
    """Move the running event loop's clock `seconds` ahead (cumulative)."""
    loop = asyncio.get_running_loop()
    offset = getattr(loop, "_test_clock_offset", 0.0) + seconds
    loop._test_clock_offset = offset  # type: ignore[attr-defined]
    loop.time = lambda: time.monotonic() + offset  # type: ignore[method-assign]
