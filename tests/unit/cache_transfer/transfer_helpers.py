"""Helpers shared by the cache_transfer tests: backends, layouts, node pairs, a raw peer."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import torch

from cache_transfer import KVLayout, KVTransferManager, make_transport
from cache_transfer.transports import KVTransport, ucx_available
from pdserve.security import ClusterAuth
from tests.waiting import wait_until as wait_until  # re-exported for the tests

# The conformance suite runs against each of these (ucx where `ucxx` imports).
BACKENDS = ("local", "tcp", "ucx") if ucx_available() else ("local", "tcp")

SENTINEL = -7.0  # what a receiver's cache holds wherever nothing may have been written


def run(coro: Coroutine[Any, Any, Any], timeout_s: float = 30.0) -> Any:
    """Run a test coroutine on a fresh event loop, bounded by `timeout_s`."""
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


def make_layout(dtype: str = "float32", num_layers: int = 3, block_size: int = 4) -> KVLayout:
    return KVLayout(
        model="test-model",
        num_layers=num_layers,
        num_kv_heads=2,
        head_dim=8,
        block_size=block_size,
        dtype=dtype,
    )


def make_kill_layout() -> KVLayout:
    """The layout peer_process.py sends: 8 layers of 512 KiB for 4096 tokens."""
    return make_layout(num_layers=8, block_size=16)


def random_caches(
    layout: KVLayout, num_blocks: int, seed: int = 0
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, *layout.block_shape)

    def one() -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(layout.torch_dtype)

    return [(one(), one()) for _ in range(layout.num_layers)]


def sentinel_caches(layout: KVLayout, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (num_blocks, *layout.block_shape)
    return [
        (
            torch.full(shape, SENTINEL, dtype=layout.torch_dtype),
            torch.full(shape, SENTINEL, dtype=layout.torch_dtype),
        )
        for _ in range(layout.num_layers)
    ]


def untouched(caches: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    """True when no block of any layer was written."""
    return all(bool((k == SENTINEL).all() and (v == SENTINEL).all()) for k, v in caches)


@dataclass
class NodePair:
    """A prefill-side manager over random KV and a decode-side manager over sentinel KV."""

    layout: KVLayout
    prefill: KVTransferManager
    decode: KVTransferManager
    src_caches: list[tuple[torch.Tensor, torch.Tensor]]
    dst_caches: list[tuple[torch.Tensor, torch.Tensor]]

    async def close(self) -> None:
        await self.prefill.close()
        await self.decode.close()


async def make_pair(
    backend: str,
    layout: KVLayout,
    num_src_blocks: int = 32,
    num_dst_blocks: int = 40,
    auth: ClusterAuth | None = None,
) -> NodePair:
    """Two managers on `backend` (with `auth`: a cluster secret, so challenged and MACed)."""
    src = random_caches(layout, num_src_blocks)
    dst = sentinel_caches(layout, num_dst_blocks)
    prefill = KVTransferManager(make_transport(backend), layout, auth=auth)
    decode = KVTransferManager(make_transport(backend), layout, dst, auth=auth)
    return NodePair(layout, prefill, decode, src, dst)


@dataclass
class RawPeer:
    """A bare transport endpoint that records what it receives: forges or drops protocol."""

    transport: KVTransport
    received: list[tuple[str, bytes]] = field(default_factory=list)

    def prepare(self, peer_id: str, header: bytes, payload_bytes: int) -> torch.Tensor:
        return torch.empty(payload_bytes, dtype=torch.uint8)

    def complete(self, peer_id: str, header: bytes, payload: torch.Tensor | None) -> None:
        self.received.append((peer_id, header))

    def abandon(self, peer_id: str, header: bytes, payload: torch.Tensor) -> None:
        pass


async def make_raw_peer(backend: str) -> RawPeer:
    peer = RawPeer(make_transport(backend))
    peer.transport.start(peer)
    return peer


async def gather_bounded(*aws: Awaitable[Any], timeout_s: float = 20.0) -> list[Any]:
    return await asyncio.wait_for(asyncio.gather(*aws), timeout_s)


def messages_handled(manager: Any) -> list[str]:
    """What `manager` did with each message from now on, recorded once the call returned:
    "prepare" (a payload's header, given a buffer), "refused" (a payload's header, given none:
    the transport drops the payload), "complete" (a whole message). A test that expects a
    message to change nothing waits until it was handled, instead of sleeping."""
    seen: list[str] = []
    for name in ("prepare", "complete"):
        real = getattr(manager, name)

        def spy(*args: Any, _real: Any = real, _name: str = name) -> Any:
            result = _real(*args)
            seen.append("refused" if _name == "prepare" and result is None else _name)
            return result

        setattr(manager, name, spy)
    return seen
