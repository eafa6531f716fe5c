"""`KVAdmission`: a decode node's bounded FIFO of requests waiting for KV blocks.

```
Decode(DISAGGREGATED) ──► reserve(request, num_tokens)    ──► AsyncEngine.reserve[_prefix]
Decode(LOCAL_PREFILL) ──► admit_local(num_tokens)          ──► room for the prompt's blocks
                                                               (free - promised to admitted
                                                               local prefills) and a seat
  room now, nobody queued ──► at once
  else, fewer than max_queued waiting ──► queued (FIFO: only the head tries, at every
      notify() and every _POLL_S) until room ──► admitted
                                      or queue_timeout_s ──► RESOURCE_EXHAUSTED (retry hint)
  else (the queue is full) ──► RESOURCE_EXHAUSTED at once (retry hint)
```

A local prefill's promise (`LocalAdmission`) is kept until its first token (its prompt's blocks
are then the engine's) or until its call ends. `release(request_id, writes_settled)` gives a
reservation's blocks back: at once, or, while a KV writer may still land in them (a transfer
written in place), detached from the request and freed once its writes settled.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from engine.async_engine import AsyncEngine, EngineDeadError
from engine.engine_core import NoFreeBlocksError
from engine.kv_reservations import PrefixReservation
from engine.request import Request

T = TypeVar("T")

_POLL_S = 0.2  # the head of the queue tries again at least this often


class AdmissionRefused(Exception):
    """No KV blocks for the request in time (or the queue is full): RESOURCE_EXHAUSTED."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(f"{message}; retry in about {retry_after_s:.0f} s")
        self.retry_after_s = retry_after_s


class LocalAdmission:
    """A local prefill's promised blocks, until `done()` (idempotent)."""

    def __init__(self, admission: KVAdmission, num_blocks: int) -> None:
        self._admission = admission
        self.num_blocks = num_blocks

    def done(self) -> None:
        if self.num_blocks:
            self._admission.num_promised_blocks -= self.num_blocks
            self._admission.num_promised_seats -= 1
            self.num_blocks = 0
            self._admission.notify()


class KVAdmission:
    def __init__(
        self,
        engine: AsyncEngine,
        block_size: int,
        max_num_seqs: int,
        max_queued: int,
        queue_timeout_s: float,
    ) -> None:
        """`max_num_seqs`: the engine's seats (requests it runs or queues at once)."""
        self._engine = engine
        self._block_size = block_size
        self._max_num_seqs = max_num_seqs
        self.max_queued = max_queued
        self.queue_timeout_s = queue_timeout_s
        self._queue: collections.deque[object] = collections.deque()
        self._changed = asyncio.Event()
        self.num_promised_blocks = 0  # to admitted local prefills without a first token yet
        self.num_promised_seats = 0  # those prefills, not yet counted by the engine's scheduler
        self.num_refused = 0
        self.num_queued_total = 0  # requests that had to wait
        self._quarantines: set[asyncio.Task[None]] = set()  # blocks freed once writes settle

    @property
    def num_queued(self) -> int:
        return len(self._queue)

    def notify(self) -> None:
        """Blocks may have been freed (a request ended): the head of the queue tries again."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def reserve(
        self,
        request_id: str,
        num_tokens: int,
        wait_s: float | None = None,
        lookup: Request | None = None,
    ) -> PrefixReservation:
        """Blocks for `num_tokens` tokens of the request's incoming KV, once there is room
        (waiting at most `wait_s`, by default the queue timeout); with `lookup` (the request's
        prompt, hashed), led by its cached prefix (`AsyncEngine.reserve_prefix`: the sender
        skips it)."""

        async def try_reserve() -> PrefixReservation | None:
            try:
                if lookup is not None:
                    return await self._engine.reserve_prefix(lookup, num_tokens)
                block_ids = await self._engine.reserve(request_id, num_tokens)
            except NoFreeBlocksError:
                return None
            return PrefixReservation(block_ids, 0, 0)

        return await self._admit(try_reserve, wait_s)

    async def admit_local(self, num_tokens: int) -> LocalAdmission:
        """Waits until the engine has room to prefill `num_tokens` tokens (and one more)."""
        num_blocks = -(-(num_tokens + 1) // self._block_size)

        async def try_admit() -> LocalAdmission | None:
            stats = await self._engine.stats()
            free = stats.num_free_blocks
            seats = self._max_num_seqs - stats.num_running - stats.num_waiting
            # Decided on the loop against the promises as they stand now: another admission may
            # have promised blocks while the engine thread was asked.
            if free - self.num_promised_blocks < num_blocks or seats <= self.num_promised_seats:
                return None
            self.num_promised_blocks += num_blocks
            self.num_promised_seats += 1
            return LocalAdmission(self, num_blocks)

        return await self._admit(try_admit)

    def release(self, request_id: str, writes_settled: asyncio.Event | None = None) -> None:
        """Free `request_id`'s reserved blocks (or abort it, past its reservation) now, or, if
        `writes_settled` is not set yet, once it is (a KV writer may still land in them)."""
        if writes_settled is None or writes_settled.is_set():
            self._engine.abort_nowait(request_id)
            return
        task = asyncio.get_running_loop().create_task(
            self._free_when_settled(request_id, writes_settled)
        )
        self._quarantines.add(task)
        task.add_done_callback(self._quarantines.discard)

    async def _free_when_settled(self, request_id: str, writes_settled: asyncio.Event) -> None:
        try:
            blocks = await self._engine.detach_reservation(request_id)
        except EngineDeadError:  # the blocks went with the engine
            return
        await writes_settled.wait()  # bounded by the receiver's quarantine timer
        self._engine.free_blocks_nowait(blocks)
        self.notify()

    async def _admit(
        self, attempt: Callable[[], Awaitable[T | None]], wait_s: float | None = None
    ) -> T:
        if not self._queue:
            result = await attempt()
            if result is not None:
                return result
        if len(self._queue) >= self.max_queued:
            self.num_refused += 1
            raise AdmissionRefused(
                f"no free KV blocks and {len(self._queue)} requests already wait for them "
                f"(--max-queued-requests {self.max_queued})",
                self.queue_timeout_s / 2,
            )
        token = object()
        self._queue.append(token)
        self.num_queued_total += 1
        deadline = time.monotonic() + (self.queue_timeout_s if wait_s is None else wait_s)
        try:
            return await self._wait_turn(token, attempt, deadline)
        finally:
            self._queue.remove(token)
            self.notify()  # the next one is head now

    async def _wait_turn(
        self, token: object, attempt: Callable[[], Awaitable[T | None]], deadline: float
    ) -> T:
        while True:
            if self._queue[0] is token:
                result = await attempt()
                if result is not None:
                    return result
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.num_refused += 1
                raise AdmissionRefused(
                    f"no KV blocks freed up within --queue-timeout-s {self.queue_timeout_s} s",
                    self.queue_timeout_s,
                )
            changed = self._changed
            try:
                async with asyncio.timeout(min(remaining, _POLL_S)):
                    await changed.wait()
            except TimeoutError:
                pass
