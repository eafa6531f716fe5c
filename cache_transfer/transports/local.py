"""`LocalTransport`: endpoints in one process and one event loop, for tests.

Peers find each other in a process-wide registry keyed by address ("local://N"). A send copies
the payload straight into the buffer the receiving handler prepared.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from typing import ClassVar

import torch

from cache_transfer.transports.base import (
    KVTransport,
    Message,
    TransportError,
    TransportHandler,
    check_messages,
    dispatch_message,
)


class LocalTransport(KVTransport):
    _endpoints: ClassVar[dict[str, LocalTransport]] = {}
    _ids: ClassVar[itertools.count[int]] = itertools.count()

    def __init__(self) -> None:
        self._address = f"local://{next(self._ids)}"
        self._handler: TransportHandler | None = None
        self._closed = False
        self._endpoints[self._address] = self

    @property
    def address(self) -> str:
        return self._address

    def start(self, handler: TransportHandler) -> None:
        if self._handler is not None:
            raise RuntimeError(f"transport {self._address} was already started")
        self._handler = handler

    async def send_many(self, peer_address: str, messages: Sequence[Message]) -> None:
        sizes = check_messages(messages)
        await asyncio.sleep(0)  # interleave with other tasks, as a real transport does
        if self._closed:
            raise TransportError(f"transport {self._address} is closed")
        peer = self._endpoints.get(peer_address)
        if peer is None or peer._handler is None:
            raise TransportError(f"no local endpoint listening at {peer_address!r}")
        for (header, payload), payload_bytes in zip(messages, sizes):

            def fill(dst: torch.Tensor, src: torch.Tensor | None = payload) -> None:
                assert src is not None  # (filled only for a message with a payload)
                dst.copy_(src)

            dispatch_message(peer._handler, self._address, bytes(header), payload_bytes, fill)

    def buffer_device(self, cache_device: torch.device) -> torch.device:
        return cache_device

    async def close(self) -> None:
        self._closed = True
        self._endpoints.pop(self._address, None)
