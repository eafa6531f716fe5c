"""`KVTransport`: moves messages (header bytes + optional payload buffer) between two endpoints.

Transports know nothing about requests. Receiving is two-phase so the receiver validates a
message and chooses where its payload lands before any byte is written:

    handler.prepare(peer_id, header, payload_bytes) -> dst | None   (None: refused, dropped)
    handler.complete(peer_id, header, dst | None)                   (the payload is in dst)
    handler.abandon(peer_id, header, dst)       (instead of complete: the connection broke)
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

logger = logging.getLogger(__name__)


Message = tuple[bytes, "torch.Tensor | None"]  # (header, payload)


class TransportError(ConnectionError):
    """A message could not be delivered (unknown or closed peer, closed transport)."""


class TransportBindError(OSError):
    """The listener could not bind its port (taken, or still held by a killed process)."""


class TransportHandler(Protocol):
    """What a transport hands incoming messages to. Called on the transport's event loop."""

    def prepare(self, peer_id: str, header: bytes, payload_bytes: int) -> torch.Tensor | None:
        """Validate a message that carries a payload; return a contiguous 1-D uint8 tensor of
        exactly `payload_bytes` on `buffer_device` to receive it, or None to refuse it."""
        ...

    def complete(self, peer_id: str, header: bytes, payload: torch.Tensor | None) -> None:
        """A whole message: `payload` is the tensor `prepare` returned, now filled (None for a
        header-only message)."""
        ...

    def abandon(self, peer_id: str, header: bytes, payload: torch.Tensor) -> None:
        """A payload `prepare` accepted will never be complete (its connection broke mid-way);
        the transport no longer writes into `payload`. Only transports that can lose a message
        half-received (ucx) call this."""
        ...


class KVTransport(abc.ABC):
    """One endpoint: a listener peers send to, plus reused connections to peers."""

    # What its node should warn about at start, in a few words (e.g. a listener that cannot
    # bind the given host), or None.
    caveat: str | None = None

    @property
    @abc.abstractmethod
    def address(self) -> str:
        """Where peers reach this endpoint, e.g. "tcp://10.0.0.5:5600"."""

    @abc.abstractmethod
    def start(self, handler: TransportHandler) -> None:
        """Deliver incoming messages to `handler`. Call from the event loop that will use the
        transport; once only."""

    async def send(
        self, peer_address: str, header: bytes, payload: torch.Tensor | None = None
    ) -> None:
        """Send one message; return once `payload` may be reused or freed. Messages to one
        peer arrive in order. Raises TransportError when the peer cannot be reached; a dead
        peer may leave this pending, so bound it with the caller's deadline."""
        await self.send_many(peer_address, [(header, payload)])

    @abc.abstractmethod
    async def send_many(self, peer_address: str, messages: Sequence[Message]) -> None:
        """Send several messages to one peer as one transport message (one zmq multipart
        message, one UCX head): fewer, larger messages. The receiver's handler still sees each
        as its own message, in order; otherwise as `send` (all payloads may be reused once it
        returns). ValueError when `messages` is empty."""

    def connection_id(self, peer_address: str) -> str:
        """The `peer_id` under which `peer_address`'s handler receives what we send it now (the
        connection a handshake proof is bound to). No two live connections to one listener
        share it: tcp, our zmq routing id (a ROUTER drops a second connection using a live
        one); ucx, the name our connection's hello gives (a listener closes a second one
        using a live name); local, our address."""
        return self.address

    def limit_inbound(self, max_frame_bytes: int) -> None:
        """Refuse, before buffering it, any incoming frame (header or payload) larger than
        `max_frame_bytes` (call before peers connect). Transports that hand the handler the
        payload size before receiving it (ucx, local) need not: `prepare` refuses first."""
        return None

    @abc.abstractmethod
    def buffer_device(self, cache_device: torch.device) -> torch.device:
        """The device payload buffers must live on for a KV cache on `cache_device`."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop receiving and drop every connection. Idempotent."""


def check_payload(payload: torch.Tensor | None) -> int:
    """Bytes in `payload` (0 for None); raise ValueError unless it is flat contiguous uint8."""
    if payload is None:
        return 0
    if payload.dtype != torch.uint8 or payload.dim() != 1 or not payload.is_contiguous():
        raise ValueError(
            f"payload must be a contiguous 1-D uint8 tensor (a packed layer), got "
            f"{payload.dtype} {list(payload.shape)}"
        )
    return payload.numel()


def check_messages(messages: Sequence[Message]) -> list[int]:
    """Each message's payload size (`check_payload`); ValueError when there is none."""
    if not messages:
        raise ValueError("send_many needs at least one message")
    return [check_payload(payload) for _, payload in messages]


def dispatch_message(
    handler: TransportHandler,
    peer_id: str,
    header: bytes,
    payload_bytes: int,
    fill: Callable[[torch.Tensor], None],
) -> None:
    """Run one incoming message through `handler`: prepare, `fill(dst)`, complete. Handler
    errors are logged, never raised into the transport's receive loop."""
    try:
        if payload_bytes == 0:
            handler.complete(peer_id, header, None)
            return
        dst = handler.prepare(peer_id, header, payload_bytes)
        if dst is None:
            return
        if check_payload(dst) != payload_bytes:
            raise ValueError(
                f"prepare returned {dst.numel()} bytes for a {payload_bytes}-byte payload"
            )
        fill(dst)
        handler.complete(peer_id, header, dst)
    except Exception:
        logger.exception("dropped a message from %s: its handler failed", peer_id)
