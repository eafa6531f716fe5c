"""KVTransport conformance: every backend moves bytes the same way (run once per backend)."""

from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass, field

import pytest
import torch
from transfer_helpers import run, wait_until

from cache_transfer import TransportError, make_transport
from cache_transfer.transports.base import KVTransport

pytestmark = pytest.mark.timeout(60)


@dataclass
class Recorder:
    """A handler that accepts every payload unless told to refuse headers starting with b"no"."""

    prepared: list[bytes] = field(default_factory=list)
    completed: list[tuple[str, bytes, torch.Tensor | None]] = field(default_factory=list)
    abandoned: list[bytes] = field(default_factory=list)  # no connection breaks in these tests
    fail_on: bytes = b"\xff"  # prepare raises on this header

    def prepare(self, peer_id: str, header: bytes, payload_bytes: int) -> torch.Tensor | None:
        self.prepared.append(header)
        if header == self.fail_on:
            raise RuntimeError("handler bug")
        if header.startswith(b"no"):
            return None
        return torch.empty(payload_bytes, dtype=torch.uint8)

    def complete(self, peer_id: str, header: bytes, payload: torch.Tensor | None) -> None:
        self.completed.append((peer_id, header, payload))

    def abandon(self, peer_id: str, header: bytes, payload: torch.Tensor) -> None:
        self.abandoned.append(header)


async def _endpoints(backend: str) -> tuple[KVTransport, KVTransport, Recorder]:
    src, dst = make_transport(backend), make_transport(backend)
    recorder = Recorder()
    src.start(Recorder())
    dst.start(recorder)
    return src, dst, recorder


def _random_bytes(num_bytes: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (num_bytes,), dtype=torch.uint8, generator=gen)


@pytest.mark.parametrize("num_bytes", [1024, (1 << 20) + 3, 64 << 20, 256 << 20])
def test_payload_arrives_byte_exact(backend: str, num_bytes: int) -> None:
    payload = _random_bytes(num_bytes, seed=num_bytes)

    async def scenario() -> None:
        src, dst, recorder = await _endpoints(backend)
        await asyncio.wait_for(src.send(dst.address, b"layer", payload), 20)
        await wait_until(lambda: len(recorder.completed) == 1, timeout_s=20)
        peer_id, header, got = recorder.completed[0]
        assert header == b"layer" and recorder.prepared == [b"layer"]
        assert got is not None and torch.equal(got, payload)
        assert recorder.abandoned == []
        await src.close()
        await dst.close()

    run(scenario())


def test_header_only_message_skips_prepare(backend: str) -> None:
    async def scenario() -> None:
        src, dst, recorder = await _endpoints(backend)
        await asyncio.wait_for(src.send(dst.address, b"ack"), 5)
        await wait_until(lambda: len(recorder.completed) == 1)
        assert recorder.completed[0][1:] == (b"ack", None)
        assert recorder.prepared == []
        await src.close()
        await dst.close()

    run(scenario())


def test_messages_to_one_peer_arrive_in_call_order_on_one_connection(backend: str) -> None:
    sizes = [7, 200_000, 64, 1 << 20, 0, 100_000, 3] * 4  # both sides of tcp's zero-copy cutoff
    payloads = [_random_bytes(n, seed=i) if n else None for i, n in enumerate(sizes)]

    async def scenario() -> None:
        src, dst, recorder = await _endpoints(backend)
        sends = [src.send(dst.address, str(i).encode(), p) for i, p in enumerate(payloads)]
        await asyncio.wait_for(asyncio.gather(*sends), 20)
        await wait_until(lambda: len(recorder.completed) == len(sizes), timeout_s=20)
        assert [h for _, h, _ in recorder.completed] == [str(i).encode() for i in range(len(sizes))]
        for (_, _, got), sent in zip(recorder.completed, payloads):
            assert (got is None) if sent is None else torch.equal(got, sent)
        assert len({peer_id for peer_id, _, _ in recorder.completed}) == 1
        await src.close()
        await dst.close()

    run(scenario())


def test_send_many_is_one_send_delivered_as_its_messages_byte_exact(backend: str) -> None:
    """Coalesced messages (one zmq message / one UCX head) reach the handler one by one, in
    order and byte-exact, interleaved correctly with single sends on the same connection."""
    sizes = [200_000, 0, 7, 1 << 20, 64]  # header-only inside, both sides of tcp's cutoff
    payloads = [_random_bytes(n, seed=10 + i) if n else None for i, n in enumerate(sizes)]
    small = [(f"s{i}".encode(), p) for i, p in enumerate(payloads[2:])]  # under the cutoff

    async def scenario() -> None:
        src, dst, recorder = await _endpoints(backend)
        batch = [(f"b{i}".encode(), p) for i, p in enumerate(payloads)]
        sends = [src.send(dst.address, b"before", payloads[2]), src.send_many(dst.address, batch),
                 src.send_many(dst.address, small), src.send(dst.address, b"after")]  # fmt: skip
        await asyncio.wait_for(asyncio.gather(*sends), 20)
        expected = [(b"before", payloads[2]), *batch, *small, (b"after", None)]
        await wait_until(lambda: len(recorder.completed) == len(expected), timeout_s=20)
        assert [h for _, h, _ in recorder.completed] == [h for h, _ in expected]
        for (_, _, got), (_, sent) in zip(recorder.completed, expected):
            assert (got is None) if sent is None else torch.equal(got, sent)
        assert len({peer_id for peer_id, _, _ in recorder.completed}) == 1
        with pytest.raises(ValueError, match="at least one message"):
            await src.send_many(dst.address, [])
        await src.close()
        await dst.close()

    run(scenario())


def test_distinct_senders_have_distinct_peer_ids_and_replies_flow_back(backend: str) -> None:
    async def scenario() -> None:
        a, dst, recorder = await _endpoints(backend)
        b = make_transport(backend)
        b_recorder = Recorder()
        b.start(b_recorder)
        await asyncio.wait_for(a.send(dst.address, b"from-a"), 5)
        await asyncio.wait_for(b.send(dst.address, b"from-b"), 5)
        await asyncio.wait_for(dst.send(b.address, b"reply"), 5)
        await wait_until(lambda: len(recorder.completed) == 2 and len(b_recorder.completed) == 1)
        peers = {header: peer_id for peer_id, header, _ in recorder.completed}
        assert peers[b"from-a"] != peers[b"from-b"]
        assert b_recorder.completed[0][1] == b"reply"
        for transport in (a, b, dst):
            await transport.close()

    run(scenario())


def test_a_refused_payload_is_dropped_and_later_messages_still_arrive(backend: str) -> None:
    async def scenario() -> None:
        src, dst, recorder = await _endpoints(backend)
        recorder.fail_on = b"bug"
        for header in (b"no-thanks", b"bug", b"yes"):
            await asyncio.wait_for(src.send(dst.address, header, _random_bytes(128 << 10, 1)), 5)
        await wait_until(lambda: len(recorder.completed) == 1)
        assert recorder.prepared == [b"no-thanks", b"bug", b"yes"]
        assert [h for _, h, _ in recorder.completed] == [b"yes"]
        await src.close()
        await dst.close()

    run(scenario())


def test_sending_to_a_closed_peer_never_delivers(backend: str) -> None:
    async def scenario() -> None:
        src, dst, recorder = await _endpoints(backend)
        await dst.close()
        # local refuses at once; tcp has no connection to send on and waits for one, except
        # that libzmq closes a listener on its I/O thread: its port may still accept for a
        # moment (a loaded machine), and the send is then queued to a peer that reads nothing
        try:
            await asyncio.wait_for(src.send(dst.address, b"late", _random_bytes(1024, 0)), 0.5)
        except (TransportError, TimeoutError):
            pass
        else:
            assert backend == "tcp", "a send to a closed peer completed"
        await asyncio.sleep(0.1)  # whatever was in flight would have landed by now
        assert recorder.completed == []
        await src.close()

    run(scenario())


def test_a_closed_transport_refuses_to_send(backend: str) -> None:
    async def scenario() -> None:
        src, dst, _ = await _endpoints(backend)
        await src.close()
        await src.close()  # idempotent
        with pytest.raises(TransportError, match="closed"):
            await asyncio.wait_for(src.send(dst.address, b"x"), 5)
        await dst.close()

    run(scenario())


def test_closing_fails_a_send_still_waiting_for_its_peer(backend: str) -> None:
    async def scenario() -> None:
        src, dst, _ = await _endpoints(backend)
        await dst.close()
        address = dst.address
        # tcp: libzmq closes a listener on its I/O thread, so the closed peer's port may still
        # accept for a moment (on a loaded machine the send then went through); a port held
        # by a socket that never listens refuses every connection
        with socket.socket() as unlistened:
            if backend == "tcp":
                unlistened.bind(("127.0.0.1", 0))
                address = f"tcp://127.0.0.1:{unlistened.getsockname()[1]}"
            pending = asyncio.create_task(src.send(address, b"x", _random_bytes(1 << 20, 0)))
            await asyncio.sleep(0.05)
            if backend == "tcp":
                assert not pending.done()  # still waiting for a peer that never answers
            await src.close()
            with pytest.raises(TransportError):
                await asyncio.wait_for(pending, 2)

    run(scenario())


def test_payload_must_be_flat_uint8(backend: str) -> None:
    async def scenario() -> None:
        src, dst, _ = await _endpoints(backend)
        with pytest.raises(ValueError, match="contiguous 1-D uint8"):
            await asyncio.wait_for(src.send(dst.address, b"x", torch.zeros(4, 4)), 5)
        await src.close()
        await dst.close()

    run(scenario())
