"""`UcxInbound`: one connection a peer opened to our listener (framing in wire.py).

    hello (message 0) ──► peer_id = its text ("<peer address>#<random>"; a name a live
                          connection has already: closed)
    per head (one or several messages, numbered on), per message, in sequence order:
        head ──► header-only: handler.complete(peer_id, header, None)
             └─► payload: dst = handler.prepare(...) ──► receive into dst (a scratch byte when
                 refused: UCX truncates and drops the rest) ──► handler.complete(..., dst)
    the connection breaks (peer died, closed, bad framing) ──► handler.abandon(...) for every
        payload prepared but not landed; the endpoint is aborted

Up to MAX_LANDING payloads land at once (their receives are posted back to back, so the link
stays busy between layers); `complete` and `abandon` are still called in sequence order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import numpy as np
import torch

from cache_transfer.transports.base import TransportHandler, check_payload
from cache_transfer.transports.cuda_waits import wait_for_stream
from cache_transfer.transports.ucx.runtime import (
    UCXCloseError,
    UCXError,
    UCXMessageTruncatedError,
    ucxx,
)
from cache_transfer.transports.ucx.wire import (
    DEVICE_WAIT_TIMEOUT_S,
    HEAD,
    MAX_HEAD_BYTES,
    PAYLOAD,
    as_ucx_buffer,
    decode_head,
    message_tag,
)

logger = logging.getLogger(__name__)

MAX_LANDING = 8  # payloads of one connection landing at once


class UcxInbound:
    def __init__(
        self,
        endpoint: ucxx.Endpoint,
        handler: TransportHandler,
        name_peer: Callable[[str], str],
    ) -> None:
        """`name_peer(the hello's text)` gives the connection's peer_id (ValueError: refused)."""
        self.peer_id = "?"
        self._endpoint = endpoint
        self._handler = handler
        self._name_peer = name_peer
        self._head = bytearray(MAX_HEAD_BYTES)
        self._window = asyncio.Semaphore(MAX_LANDING)
        self._last: asyncio.Task[None] | None = None  # the newest message still landing
        self._broken = False  # from the first failed payload on, nothing more is completed
        self.done = asyncio.Event()

    async def run(self) -> None:
        """Read messages until the connection ends, then settle what was landing."""
        try:
            hello = await self._recv_head(0)
            if len(hello) != 1 or hello[0][1]:
                raise ValueError("the hello is not one header-only message")
            header = hello[0][0]
            self.peer_id = self._name_peer(header.decode(errors="replace")[:256])
            await self._read()
        except UCXError as error:  # the peer closed or died, or we closed
            logger.info("ucx connection from %s ended: %r", self.peer_id, error)
        except ValueError as error:
            logger.warning("closed the ucx connection from %s: %s", self.peer_id, error)
        except Exception:
            logger.exception("ucx connection from %s failed", self.peer_id)
        finally:
            self.close()
            if self._last is not None:
                await asyncio.wait({self._last})
            self.done.set()

    def close(self) -> None:
        """Abort the endpoint: receives in flight fail, `run` returns."""
        self._broken = True
        self._endpoint.abort()

    async def _read(self) -> None:
        seq = 1
        while True:
            entries = await self._recv_head(seq)
            for header, payload_bytes in entries:
                await self._take(seq, header, payload_bytes)
                seq += 1

    async def _take(self, seq: int, header: bytes, payload_bytes: int) -> None:
        """Message `seq`: deliver it, or post its payload's receive and land it in order."""
        if payload_bytes == 0 and (self._last is None or self._last.done()):
            self._deliver(header, None)
            return
        await self._window.acquire()
        dst = self._prepare(header, payload_bytes) if payload_bytes else None
        receive = None
        if payload_bytes:
            receive = asyncio.ensure_future(self._recv_payload(seq, dst))
        self._last = asyncio.ensure_future(self._land(header, dst, receive, self._last))

    async def _recv_head(self, seq: int) -> list[tuple[bytes, int]]:
        try:
            await self._recv(self._head, message_tag(seq, HEAD))
        except UCXMessageTruncatedError:
            raise ValueError(f"a message head over {MAX_HEAD_BYTES} bytes") from None
        return decode_head(self._head)

    async def _recv(self, buffer: object, tag: int) -> None:
        if self._endpoint.closed:  # ucxx cannot receive on an aborted endpoint
            raise UCXCloseError("the endpoint is closed")
        await self._endpoint.recv(buffer, tag=tag)

    def _prepare(self, header: bytes, payload_bytes: int) -> torch.Tensor | None:
        try:
            dst = self._handler.prepare(self.peer_id, header, payload_bytes)
            if dst is not None and check_payload(dst) != payload_bytes:
                self._handler.abandon(self.peer_id, header, dst)
                raise ValueError(f"prepare returned {dst.numel()} bytes for {payload_bytes}")
            return dst
        except Exception:
            logger.exception("dropped a message from %s: its handler failed", self.peer_id)
            return None

    async def _recv_payload(self, seq: int, dst: torch.Tensor | None) -> None:
        tag = message_tag(seq, PAYLOAD)
        if dst is None:  # refused: receive one byte, UCX drops the rest
            with contextlib.suppress(UCXMessageTruncatedError):
                await self._recv(np.empty(1, dtype=np.uint8), tag)
            return
        # nothing queued on the stream may still read dst
        await wait_for_stream(dst, DEVICE_WAIT_TIMEOUT_S)
        await self._recv(as_ucx_buffer(dst), tag)

    async def _land(
        self,
        header: bytes,
        dst: torch.Tensor | None,
        receive: asyncio.Future[None] | None,
        previous: asyncio.Task[None] | None,
    ) -> None:
        """Wait for the payload and the previous message, then hand the message over."""
        try:
            failed = False
            if receive is not None:
                await asyncio.wait({receive})
                failed = receive.cancelled() or receive.exception() is not None
            if previous is not None:
                await asyncio.wait({previous})
            self._broken |= failed  # this message and every later one are lost
            if receive is None or dst is not None:
                self._deliver(header, dst)
        finally:
            self._window.release()

    def _deliver(self, header: bytes, dst: torch.Tensor | None) -> None:
        try:
            if self._broken and dst is not None:
                self._handler.abandon(self.peer_id, header, dst)
            elif not self._broken:
                self._handler.complete(self.peer_id, header, dst)
        except Exception:
            logger.exception("dropped a message from %s: its handler failed", self.peer_id)
