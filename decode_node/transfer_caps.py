"""`TransferCaps`: server-side bounds on what Decode(DISAGGREGATED) callers may hold while
their KV is awaited, so no caller can pin the KV pool (issue 15: twelve Decode calls asking
for a 1e9 s hand-off and sending nothing held every block, and later requests hung).

```
timeout_s(asked, default)     the hand-off deadline: `asked` (0: the node's default), clamped
                              to --max-transfer-timeout-s
acquire(caller, num_blocks, wait_s, trusted)
                              a PendingHold; when `caller` would hold more than
                              --max-pending-kv-share of the pool, it waits (bounded by wait_s,
                              outside the admission FIFO: nobody else waits behind it) for the
                              caller's own hand-offs to resolve; TransferCapExceeded
                              (RESOURCE_EXHAUSTED) when they do not in time, at once when
                              --max-queued-requests calls already wait so, or when the node
                              already awaits --max-pending-transfers hand-offs
hold.release()                the hand-off resolved (landed, failed, timed out, or the call
                              ended); idempotent
```

A caller is one gRPC connection (`context.peer()`: a router keeps one channel per node, so its
calls share one); the total cap bounds callers that open many connections. A `trusted` caller,
one that proved the cluster secret (the router: with a secret every call to the node must),
has no per-caller cap: every legitimate request comes through the router's one connection, so
its requests are measured against the pool's free blocks alone (KVAdmission). The share caps
the callers a node cannot tell apart from an attacker: those of an open cluster (issue 39:
three 1,500-token requests, their prefill node stopped, the third refused while 176 of 364
blocks were free).
"""

from __future__ import annotations

import asyncio
import collections
import math


class TransferCapExceeded(Exception):
    """The caller (or the node) already awaits as much KV as it may: RESOURCE_EXHAUSTED."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(f"{message}; retry in about {retry_after_s:.3g} s")
        self.retry_after_s = retry_after_s


class PendingHold:
    """One hand-off's blocks, counted against its caller until `release()`."""

    def __init__(self, caps: TransferCaps, caller: str, num_blocks: int) -> None:
        self._caps = caps
        self.caller = caller
        self.num_blocks = num_blocks
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._caps._release(self)


class TransferCaps:
    def __init__(
        self,
        num_pool_blocks: int,
        max_timeout_s: float,
        max_caller_share: float,
        max_pending: int,
        max_waiting: int,
    ) -> None:
        self.max_timeout_s = max_timeout_s
        self.max_caller_share = max_caller_share
        # share 1: no per-caller cap (the admission queue alone bounds the wait for blocks)
        self.max_caller_blocks = (
            max(1, math.floor(num_pool_blocks * max_caller_share))
            if max_caller_share < 1
            else math.inf
        )
        self.max_pending = max_pending
        self.max_waiting = max_waiting  # over-cap calls waiting at once (--max-queued-requests)
        self.num_pending = 0  # holds, and callers waiting for one
        self.num_waiting = 0
        self.num_refused = 0
        self._blocks_by_caller: collections.Counter[str] = collections.Counter()
        self._released = asyncio.Event()

    def timeout_s(self, asked_s: float, default_s: float) -> float:
        return min(asked_s or default_s, self.max_timeout_s)

    def blocks_held(self, caller: str) -> int:
        return self._blocks_by_caller[caller]

    async def acquire(
        self, caller: str, num_blocks: int, wait_s: float, trusted: bool = False
    ) -> PendingHold:
        """A hold of `num_blocks` for `caller`: at once when it is `trusted` or its holds leave
        room under its cap (a caller holding nothing may take one of any size), else once its
        own earlier hand-offs resolve, within `wait_s` (the queue timeout). Other callers never
        wait behind it. TransferCapExceeded when the node awaits too many hand-offs, or in time."""
        if self.num_pending >= self.max_pending:
            self.num_refused += 1
            raise TransferCapExceeded(
                f"{self.num_pending} KV hand-offs are already awaited on this node "
                f"(--max-pending-transfers {self.max_pending})",
                self.max_timeout_s / 4,
            )
        over_cap = (
            f"this caller ({caller}) holds {self.blocks_held(caller)} KV blocks in reservations "
            f"awaiting KV; {num_blocks} more exceed its cap of {self.max_caller_blocks} "
            f"(--max-pending-kv-share {self.max_caller_share:g} of the pool)"
        )
        if trusted:
            self.num_pending += 1
            self._blocks_by_caller[caller] += num_blocks
            return PendingHold(self, caller, num_blocks)
        if self._over_cap(caller, num_blocks) and self.num_waiting >= self.max_waiting:
            self.num_refused += 1
            raise TransferCapExceeded(
                f"{over_cap} and {self.num_waiting} calls already wait (--max-queued-requests "
                f"{self.max_waiting})",
                self.max_timeout_s / 4,
            )
        self.num_pending += 1
        self.num_waiting += 1
        try:
            async with asyncio.timeout(wait_s):
                while self._over_cap(caller, num_blocks):
                    await self._released.wait()
        except TimeoutError:
            self.num_pending -= 1
            self.num_refused += 1
            raise TransferCapExceeded(
                f"{over_cap} and none of its hand-offs resolved within {wait_s:g} s",
                self.max_timeout_s / 4,
            ) from None
        except BaseException:
            self.num_pending -= 1
            raise
        finally:
            self.num_waiting -= 1
        self._blocks_by_caller[caller] += num_blocks
        return PendingHold(self, caller, num_blocks)

    def _over_cap(self, caller: str, num_blocks: int) -> bool:
        held = self._blocks_by_caller[caller]
        return held > 0 and held + num_blocks > self.max_caller_blocks

    def _release(self, hold: PendingHold) -> None:
        self.num_pending -= 1
        left = self._blocks_by_caller[hold.caller] - hold.num_blocks
        if left:
            self._blocks_by_caller[hold.caller] = left
        else:
            del self._blocks_by_caller[hold.caller]
        self._released.set()  # wake every waiter: each re-checks its own caller
        self._released = asyncio.Event()
