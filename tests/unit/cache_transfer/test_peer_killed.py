"""A prefill process SIGKILLed mid-transfer: the receiver's session fails within its deadline,
every layer is either whole or untouched, and nothing it held stays lent (run for the backends
that cross processes)."""

from __future__ import annotations

import asyncio
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from transfer_helpers import (
    BACKENDS,
    SENTINEL,
    make_kill_layout,
    random_caches,
    run,
    sentinel_caches,
    wait_until,
)

from cache_transfer import KVTransferManager, TransferState, make_transport
from tests.child_env import child_env

pytestmark = pytest.mark.timeout(120)

PEER_SCRIPT = Path(__file__).with_name("peer_process.py")
CROSS_PROCESS_BACKENDS = [b for b in BACKENDS if b != "local"]
NUM_TOKENS = 4096


async def _start_peer(mode: str, backend: str) -> asyncio.subprocess.Process:
    peer = await asyncio.create_subprocess_exec(
        sys.executable, str(PEER_SCRIPT), mode, backend,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=child_env(),
    )  # fmt: skip
    assert peer.stdout is not None
    line = await asyncio.wait_for(peer.stdout.readline(), 60)
    assert line == b"ready\n", line
    return peer


async def _kill(peer: asyncio.subprocess.Process) -> None:
    peer.send_signal(signal.SIGKILL)
    await asyncio.wait_for(peer.wait(), 10)


@pytest.mark.parametrize("backend", CROSS_PROCESS_BACKENDS)
def test_sender_killed_mid_transfer_fails_the_receiver_within_its_deadline(backend: str) -> None:
    layout = make_kill_layout()
    num_blocks = layout.num_blocks_for(NUM_TOKENS)
    dst_ids = list(range(num_blocks, 2 * num_blocks))[::-1]

    async def scenario() -> None:
        peer = await _start_peer("layers", backend)
        dst = sentinel_caches(layout, 2 * num_blocks)
        manager = KVTransferManager(make_transport(backend), layout, dst)
        receiver = manager.create_receiver(dst_ids, NUM_TOKENS, timeout_s=5)
        assert peer.stdin is not None
        peer.stdin.write(receiver.ticket().SerializeToString().hex().encode() + b"\n")
        await wait_until(lambda: receiver.state == TransferState.TRANSFERRING, timeout_s=5)
        await _kill(peer)

        assert await receiver.wait() == TransferState.FAILED
        assert receiver.elapsed_s < receiver.timeout_s + 0.5
        assert manager.num_pending == 0 and manager.num_failed == 1
        assert manager.get(receiver.transfer_id) is None  # the node frees its blocks now
        assert manager._staging.num_lent == 0
        src = random_caches(layout, num_blocks)
        num_whole = 0
        for (src_k, src_v), (dst_k, dst_v) in zip(src, dst):
            landed = (dst_k[dst_ids], dst_v[dst_ids])
            if torch.equal(landed[0], src_k) and torch.equal(landed[1], src_v):
                num_whole += 1
            else:  # a layer is whole or untouched, never half written
                assert bool((landed[0] == SENTINEL).all() and (landed[1] == SENTINEL).all())
        assert 1 <= num_whole < layout.num_layers
        await manager.close()

    run(scenario(), timeout_s=90)


@dataclass
class _KillOnPrepare:
    """A handler that SIGKILLs the sending process in prepare(), before its payload lands."""

    peer: asyncio.subprocess.Process
    completed: list[bytes] = field(default_factory=list)
    abandoned: list[bytes] = field(default_factory=list)

    def prepare(self, peer_id: str, header: bytes, payload_bytes: int) -> torch.Tensor:
        self.peer.send_signal(signal.SIGKILL)
        return torch.full((payload_bytes,), 7, dtype=torch.uint8)

    def complete(self, peer_id: str, header: bytes, payload: torch.Tensor | None) -> None:
        self.completed.append(header)

    def abandon(self, peer_id: str, header: bytes, payload: torch.Tensor) -> None:
        self.abandoned.append(header)


@pytest.mark.parametrize("backend", CROSS_PROCESS_BACKENDS)
def test_a_payload_cut_off_by_a_killed_peer_is_whole_or_abandoned(backend: str) -> None:
    """tcp delivers whole messages only (the bytes were in before prepare); ucx has not moved
    the payload when prepare returns, and abandons it once the connection breaks."""

    async def scenario() -> None:
        peer = await _start_peer("payload", backend)
        handler = _KillOnPrepare(peer)
        transport = make_transport(backend)
        transport.start(handler)
        assert peer.stdin is not None
        peer.stdin.write(f"{transport.address} {256 << 20}\n".encode())
        await asyncio.wait_for(peer.wait(), 30)
        await wait_until(lambda: bool(handler.completed or handler.abandoned), timeout_s=5)
        if backend == "ucx":
            assert handler.abandoned == [b"big"] and handler.completed == []
        else:
            assert handler.completed == [b"big"] and handler.abandoned == []
        await transport.close()

    run(scenario(), timeout_s=90)
