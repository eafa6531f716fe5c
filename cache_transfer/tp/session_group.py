"""`SessionGroup`: one tensor-parallel hand-off seen as one session, over its parts.

A part is a route's `KVSender` / `KVReceiver` on this rank, or a `RemotePart`: another rank's
share, which that rank reports on (the node carries the report: node_common/tp/).

```
add(part) ... seal()          parts join (a decode rank's routes arrive one by one); sealed: no
                              more will, so the group may succeed
any part FAILED ──► FAILED: every other part aborted (its peer told), the same reason
abort() / cancel() (nobody needs it: the parts cancelled, DEBUG) ──► FAILED
every part SUCCESS, sealed ──► SUCCESS
the deadline (timeout_s, from creation) ──► FAILED     a part that never comes or never ends
seal_by(t): not sealed within t ──► FAILED             a route that never comes
writes_settled: set once finished and every part settled (no write of any can land any more:
                a receiver's writes_settled, a remote rank's report)
```
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol

from cache_transfer.state import TransferState

logger = logging.getLogger(__name__)


class Part(Protocol):
    """What a group needs of a part (`TransferSession` and `RemotePart` have it)."""

    @property
    def transfer_id(self) -> str: ...
    @property
    def state(self) -> TransferState: ...
    @property
    def error(self) -> str | None: ...
    @property
    def finished(self) -> bool: ...
    def add_finish_callback(self, callback: Callable[[Part], None]) -> None: ...
    def abort(self, reason: str) -> None: ...
    def cancel(self, reason: str) -> None: ...


class RemotePart:
    """Another rank's share of the hand-off: it ends when that rank reports (`resolve`); an
    abort tells the rank (`on_abort`) and ends it at once, settled only by the report."""

    def __init__(self, transfer_id: str, rank: int, on_abort: Callable[[str], None]) -> None:
        self.transfer_id = f"{transfer_id} (rank {rank})"
        self.rank = rank
        self.state = TransferState.WAITING
        self.error: str | None = None
        self.num_bytes = 0  # KV bytes the rank reported moving
        self.settled = asyncio.Event()  # the rank reported: nothing of it writes any more
        self._on_abort = on_abort
        self._callbacks: list[Callable[[RemotePart], None]] = []

    @property
    def finished(self) -> bool:
        return self.state.finished

    def add_finish_callback(self, callback: Callable[[RemotePart], None]) -> None:
        self._callbacks.append(callback)

    def resolve(self, ok: bool, error: str = "", num_bytes: int = 0) -> None:
        """The rank's report: its share succeeded, or why it failed (and the bytes it moved)."""
        self.num_bytes = num_bytes
        self.settled.set()
        self._end(TransferState.SUCCESS if ok else TransferState.FAILED, error or None)

    def abort(self, reason: str) -> None:
        if not self.finished:
            self._on_abort(reason)
            self._end(TransferState.FAILED, f"aborted: {reason}")

    def cancel(self, reason: str) -> None:
        self.abort(reason)  # (the rank cancels its own sessions: Abort says which)

    def _end(self, state: TransferState, error: str | None) -> None:
        if self.finished:
            return
        self.state, self.error = state, error
        for callback in self._callbacks:
            callback(self)


class SessionGroup:
    def __init__(self, transfer_id: str, timeout_s: float) -> None:
        self.transfer_id = transfer_id
        self.error: str | None = None
        self.parts: list[Part] = []
        self.writes_settled = asyncio.Event()
        self._state: TransferState | None = None  # once finished
        self._settling: asyncio.Task[None] | None = None
        self._sealed = False
        self._done = asyncio.Event()
        self._callbacks: list[Callable[[SessionGroup], None]] = []
        self._loop = asyncio.get_running_loop()
        self._start_s = self._loop.time()
        self._timer = self._loop.call_later(timeout_s, self._on_deadline, timeout_s)
        self._seal_timer: asyncio.TimerHandle | None = None

    @property
    def state(self) -> TransferState:
        if self._state is not None:
            return self._state
        return min((p.state for p in self.parts), default=TransferState.BOOTSTRAPPING)

    @property
    def finished(self) -> bool:
        return self._state is not None

    @property
    def elapsed_s(self) -> float:
        return self._loop.time() - self._start_s

    def add(self, part: Part) -> None:
        """A part joins (aborted at once if the group has already failed)."""
        self.parts.append(part)
        if self._state == TransferState.FAILED:
            part.abort(self.error or "the hand-off failed")
        part.add_finish_callback(self._on_part)
        if part.finished:
            self._on_part(part)

    def discard(self, part: Part) -> None:
        """A part that will not take part after all (its end no longer counts)."""
        if part in self.parts:
            self.parts.remove(part)

    def seal(self) -> None:
        """No more parts: the group succeeds once each has."""
        self._sealed = True
        self._maybe_succeed()

    def add_finish_callback(self, callback: Callable[[SessionGroup], None]) -> None:
        self._callbacks.append(callback)

    async def wait(self) -> TransferState:
        await self._done.wait()
        assert self._state is not None
        return self._state

    def abort(self, reason: str) -> None:
        self.fail(f"aborted: {reason}")

    def cancel(self, reason: str) -> None:
        """`abort`, for a hand-off nobody needs any more: the parts cancelled (DEBUG)."""
        self.fail(f"cancelled: {reason}", cancel=True)

    def fail(self, reason: str, cancel: bool = False) -> None:
        """FAILED, every part aborted (`cancel`: cancelled), their peers told."""
        if self.finished:
            return
        self.error = reason
        self._end(TransferState.FAILED)
        for part in list(self.parts):
            (part.cancel if cancel else part.abort)(reason)

    def seal_by(self, timeout_s: float) -> None:
        """FAILED unless sealed within `timeout_s` (the parts that must come did not)."""

        def check() -> None:
            if not self._sealed:
                self.fail(f"not every route of the hand-off came within {timeout_s:.3g}s")

        self._seal_timer = self._loop.call_later(timeout_s, check)

    def _on_part(self, part: Part) -> None:
        if part not in self.parts:
            return
        if part.state == TransferState.FAILED:
            self.fail(f"{part.transfer_id}: {part.error}")
        self._maybe_succeed()

    def _maybe_succeed(self) -> None:
        succeeded = all(p.state == TransferState.SUCCESS for p in self.parts)
        if self._sealed and not self.finished and self.parts and succeeded:
            self._end(TransferState.SUCCESS)

    def _end(self, state: TransferState) -> None:
        self._state = state
        self._timer.cancel()
        if self._seal_timer is not None:
            self._seal_timer.cancel()
        self._done.set()
        for callback in self._callbacks:
            callback(self)
        self._settling = self._loop.create_task(self._settle())

    async def _settle(self) -> None:
        """Once every part is settled (bounded by the parts' own deadlines and reports)."""
        for part in list(self.parts):
            settled = getattr(part, "writes_settled", None) or getattr(part, "settled", None)
            if settled is not None:
                await settled.wait()
        self.writes_settled.set()

    def _on_deadline(self, timeout_s: float) -> None:
        self.fail(f"the tensor-parallel hand-off did not complete within {timeout_s:.3g}s")
