"""`CoalescingTransport`: sends to one peer begun in the same event-loop turn go out as one
transport message.

The prefill node's transfers of one batch each hand their layers over on their own, but a
batched prefill computes every request's layer at once, so the sends to one decode node start
together. Here they join: the first send to a peer opens a *batch* and schedules its flush (a
task, so it runs after everything already ready in this turn); later sends to that peer append
to it until it runs; the flush sends the batch with the wrapped transport's `send_many` (one
zmq multipart message, one UCX head) and every caller returns when it is sent.

    send_many(peer, A) ─┐  same turn        next turn
    send_many(peer, B) ─┼─► batch [A.., B.., C..] ──► inner.send_many(peer, [A.., B.., C..])
    send_many(peer, C) ─┘                               └─► A, B and C return (or all raise)

What the transport contract promises still holds: a message's place is fixed when its send is
called (it joins the open batch, or opens the next, whose flush runs after this one's), so
messages to one peer arrive in the order their sends began; a caller's messages stay one
transport message and in its order; the caller returns once its payloads may be reused.
A caller that gives up (its deadline) leaves the batch in flight: the transport may still be
reading its buffers, which the batch keeps referenced until it is sent. A batch holds at most
`max_messages` messages, `max_header_bytes` of headers (the ucx head is 64 KiB) and
`max_payload_bytes` of payloads (past that, per-message costs no longer matter: a larger batch
only delays its first message's completion); a caller that alone exceeds them goes alone.
A caller's malformed message fails only that caller (checked before it joins).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from cache_transfer.transports.base import (
    KVTransport,
    Message,
    TransportError,
    TransportHandler,
    check_messages,
)

MAX_MESSAGES = 256
MAX_HEADER_BYTES = 32 << 10  # half the ucx head's cap: its preambles take 16 bytes a message
MAX_PAYLOAD_BYTES = 64 << 20


@dataclass
class _Batch:
    sent: asyncio.Future[None]  # resolved (or failed) once the inner transport sent it
    messages: list[Message] = field(default_factory=list)
    callers: int = 0
    header_bytes: int = 0
    payload_bytes: int = 0


class CoalescingTransport(KVTransport):
    """Wraps `inner`; everything but `send_many` is the inner transport's own."""

    def __init__(
        self,
        inner: KVTransport,
        *,
        max_messages: int = MAX_MESSAGES,
        max_header_bytes: int = MAX_HEADER_BYTES,
        max_payload_bytes: int = MAX_PAYLOAD_BYTES,
    ) -> None:
        self.inner = inner
        self.max_messages = max_messages
        self.max_header_bytes = max_header_bytes
        self.max_payload_bytes = max_payload_bytes
        self.num_sends = 0  # callers' sends
        self.num_batches = 0  # the inner transport's sends they went out as
        self._open: dict[str, _Batch] = {}  # by peer: the batch whose flush has not run yet
        self._flushing: set[asyncio.Task[None]] = set()

    @property
    def address(self) -> str:
        return self.inner.address

    def start(self, handler: TransportHandler) -> None:
        self.inner.start(handler)

    def connection_id(self, peer_address: str) -> str:
        return self.inner.connection_id(peer_address)

    def limit_inbound(self, max_frame_bytes: int) -> None:
        self.inner.limit_inbound(max_frame_bytes)

    def buffer_device(self, cache_device: torch.device) -> torch.device:
        return self.inner.buffer_device(cache_device)

    async def close(self) -> None:
        await self.inner.close()  # batches not flushed yet fail there (a closed transport)

    async def send_many(self, peer_address: str, messages: Sequence[Message]) -> None:
        payload_bytes = sum(check_messages(messages))  # a malformed send fails alone
        header_bytes = sum(len(header) for header, _ in messages)
        batch = self._open.get(peer_address)
        if batch is None or not self._fits(batch, len(messages), header_bytes, payload_bytes):
            batch = self._open_batch(peer_address)
        batch.messages.extend(messages)
        batch.callers += 1
        batch.header_bytes += header_bytes
        batch.payload_bytes += payload_bytes
        self.num_sends += 1
        # shielded: a caller that gives up must not cancel the others' send, nor free buffers
        # the transport may still read (the batch holds them until it is sent)
        await asyncio.shield(batch.sent)

    def _fits(self, batch: _Batch, num: int, header_bytes: int, payload_bytes: int) -> bool:
        return (
            len(batch.messages) + num <= self.max_messages
            and batch.header_bytes + header_bytes <= self.max_header_bytes
            and batch.payload_bytes + payload_bytes <= self.max_payload_bytes
        )

    def _open_batch(self, peer_address: str) -> _Batch:
        loop = asyncio.get_running_loop()
        batch = _Batch(loop.create_future())
        batch.sent.add_done_callback(_retrieve)
        self._open[peer_address] = batch  # a full batch stays queued: its flush comes first
        task = loop.create_task(self._flush(peer_address, batch))
        self._flushing.add(task)
        task.add_done_callback(self._flushing.discard)
        return batch

    async def _flush(self, peer_address: str, batch: _Batch) -> None:
        if self._open.get(peer_address) is batch:
            del self._open[peer_address]
        self.num_batches += 1
        try:
            await self.inner.send_many(peer_address, batch.messages)
        except asyncio.CancelledError:  # the loop is shutting down
            batch.sent.set_exception(TransportError("the send was cancelled: shutting down"))
            raise
        except Exception as error:  # noqa: BLE001 - every caller sees what happened
            batch.sent.set_exception(error)
        else:
            batch.sent.set_result(None)


def _retrieve(sent: asyncio.Future[None]) -> None:
    """Mark a batch's failure seen: its callers may all have given up already."""
    if not sent.cancelled():
        sent.exception()
