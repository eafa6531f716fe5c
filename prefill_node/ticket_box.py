"""`TicketBox`: tickets that follow their Prefill call, matched by request id (event loop only).

```
Prefill without a ticket    expect(request_id) -> Future[TransferTicket]   (one per request id)
                            ... await it (the caller bounds the wait) ... drop(request_id)
AttachTicket(id, ticket)    put(id, ticket): settles the call's future          -> ATTACHED
                            no call of that id yet: kept for EARLY_TICKET_TTL_S -> EARLY
                            (its call may still be on its way: two RPCs of one channel are
                            not ordered), at most max_early of them             -> FULL
                            the call already has its ticket                     -> DUPLICATE
```

A ticket is only data here: the Prefill call checks it (layout, size, signature through the
sender) when it takes it, exactly as one sent inside the call.
"""

from __future__ import annotations

import asyncio
import enum

from pdserve.v1 import node_pb2

EARLY_TICKET_TTL_S = 10.0  # an AttachTicket before its Prefill call: how long it waits for it
MAX_EARLY_TICKETS = 1024  # such tickets kept at once (memory bound against a flood)


class PutResult(enum.Enum):
    ATTACHED = "attached"  # a waiting Prefill call has it
    EARLY = "early"  # kept for a call that has not arrived yet
    FULL = "full"  # refused: too many early tickets
    DUPLICATE = "duplicate"  # refused: that call already has a ticket


class TicketBox:
    def __init__(
        self, early_ttl_s: float = EARLY_TICKET_TTL_S, max_early: int = MAX_EARLY_TICKETS
    ) -> None:
        self._futures: dict[str, asyncio.Future[node_pb2.TransferTicket]] = {}
        self._early: dict[str, asyncio.TimerHandle] = {}  # request ids whose ticket came first
        self._early_ttl_s = early_ttl_s
        self._max_early = max_early

    def expect(self, request_id: str) -> asyncio.Future[node_pb2.TransferTicket]:
        """The future of `request_id`'s ticket (already settled if it came first)."""
        timer = self._early.pop(request_id, None)
        if timer is not None:
            timer.cancel()
            return self._futures[request_id]
        if request_id in self._futures:
            raise ValueError(f"request {request_id!r} already waits for a ticket")
        future = asyncio.get_running_loop().create_future()
        self._futures[request_id] = future
        return future

    def put(self, request_id: str, ticket: node_pb2.TransferTicket) -> PutResult:
        future = self._futures.get(request_id)
        if future is not None:
            if future.done():
                return PutResult.DUPLICATE
            future.set_result(ticket)
            return PutResult.ATTACHED
        if len(self._early) >= self._max_early:
            return PutResult.FULL
        future = asyncio.get_running_loop().create_future()
        future.set_result(ticket)
        self._futures[request_id] = future
        self._early[request_id] = asyncio.get_running_loop().call_later(
            self._early_ttl_s, self._expire, request_id
        )
        return PutResult.EARLY

    def drop(self, request_id: str) -> None:
        """The call ended: forget its ticket (a later AttachTicket for it is an early one that
        expires)."""
        future = self._futures.pop(request_id, None)
        if future is not None and not future.done():
            future.cancel()

    def __len__(self) -> int:
        return len(self._futures)

    def _expire(self, request_id: str) -> None:
        if self._early.pop(request_id, None) is not None:
            self._futures.pop(request_id, None)
