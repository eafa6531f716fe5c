"""`CoalescingTransport`: sends to one peer begun in the same event-loop turn go out as one
transport message, in call order; each caller's messages stay together; caps, failures and
callers that give up are each the caller's own business."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest
import torch

from cache_transfer.transports.base import KVTransport, Message, TransportError
from cache_transfer.transports.coalescing import CoalescingTransport

pytestmark = pytest.mark.timeout(60)


class RecordingTransport(KVTransport):
    """Records each send_many; a send waits on `gate` (when set) before it completes."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, list[bytes]]] = []  # (peer, headers) per inner send
        self.gate: asyncio.Event | None = None
        self.fail_with: Exception | None = None

    @property
    def address(self) -> str:
        return "fake://0"

    def start(self, handler) -> None:
        pass

    async def send_many(self, peer_address: str, messages: Sequence[Message]) -> None:
        self.sent.append((peer_address, [header for header, _ in messages]))
        if self.gate is not None:
            await self.gate.wait()
        if self.fail_with is not None:
            raise self.fail_with

    def buffer_device(self, cache_device: torch.device) -> torch.device:
        return cache_device

    async def close(self) -> None:
        pass


def payload(num_bytes: int = 16) -> torch.Tensor:
    return torch.zeros(num_bytes, dtype=torch.uint8)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_sends_begun_in_one_turn_go_as_one_message_in_call_order() -> None:
    async def main() -> None:
        inner = RecordingTransport()
        transport = CoalescingTransport(inner)
        await asyncio.gather(
            transport.send_many("p", [(b"a0", payload()), (b"a1", payload())]),
            transport.send("p", b"b0"),
            transport.send_many("q", [(b"q0", payload())]),  # another peer: its own message
            transport.send("p", b"c0", payload()),
        )
        assert inner.sent == [("p", [b"a0", b"a1", b"b0", b"c0"]), ("q", [b"q0"])]
        assert (transport.num_sends, transport.num_batches) == (4, 2)
        await transport.send("p", b"d0")  # a later turn: a message of its own
        assert inner.sent[-1] == ("p", [b"d0"])

    run(main())


def test_callers_return_once_their_batch_is_sent() -> None:
    async def main() -> None:
        inner = RecordingTransport()
        inner.gate = asyncio.Event()
        transport = CoalescingTransport(inner)
        sends = [asyncio.ensure_future(transport.send("p", h, payload())) for h in (b"a", b"b")]
        await asyncio.sleep(0.05)
        assert inner.sent == [("p", [b"a", b"b"])] and not any(s.done() for s in sends)
        inner.gate.set()
        await asyncio.gather(*sends)

    run(main())


@pytest.mark.parametrize(
    "caps, expected",
    [
        ({"max_messages": 2}, [["a0", "a1"], ["b0", "b1"], ["c0"]]),
        ({"max_header_bytes": 5}, [["a0", "a1"], ["b0", "b1"], ["c0"]]),
        ({"max_payload_bytes": 40}, [["a0", "a1"], ["b0", "b1", "c0"]]),
    ],
    ids=["messages", "header-bytes", "payload-bytes"],
)
def test_a_full_batch_is_followed_by_the_next_in_order(caps, expected) -> None:
    async def main() -> None:
        inner = RecordingTransport()
        transport = CoalescingTransport(inner, **caps)
        await asyncio.gather(
            transport.send_many("p", [(b"a0", payload()), (b"a1", payload())]),
            transport.send_many("p", [(b"b0", payload()), (b"b1", payload())]),
            transport.send_many("p", [(b"c0", None)]),
        )
        assert [[h.decode() for h in headers] for _, headers in inner.sent] == expected

    run(main())


def test_a_caller_over_the_caps_alone_goes_alone_and_whole() -> None:
    async def main() -> None:
        inner = RecordingTransport()
        transport = CoalescingTransport(inner, max_messages=2)
        big = [(f"x{i}".encode(), payload()) for i in range(3)]
        await asyncio.gather(transport.send("p", b"a"), transport.send_many("p", big))
        assert [headers for _, headers in inner.sent] == [[b"a"], [b"x0", b"x1", b"x2"]]

    run(main())


def test_a_malformed_send_fails_alone() -> None:
    async def main() -> None:
        inner = RecordingTransport()
        transport = CoalescingTransport(inner)
        bad = torch.zeros(4, dtype=torch.float32)
        results = await asyncio.gather(
            transport.send("p", b"a", payload()),
            transport.send("p", b"bad", bad),
            transport.send_many("p", []),
            transport.send("p", b"c"),
            return_exceptions=True,
        )
        assert results[0] is None and results[3] is None
        assert isinstance(results[1], ValueError) and "uint8" in str(results[1])
        assert isinstance(results[2], ValueError)
        assert inner.sent == [("p", [b"a", b"c"])]

    run(main())


def test_a_failed_batch_fails_every_caller_in_it() -> None:
    async def main() -> None:
        inner = RecordingTransport()
        inner.fail_with = TransportError("connection reset")
        transport = CoalescingTransport(inner)
        results = await asyncio.gather(
            transport.send("p", b"a"), transport.send("p", b"b"), return_exceptions=True
        )
        assert all(isinstance(r, TransportError) for r in results)
        inner.fail_with = None
        await transport.send("p", b"c")  # the next batch is unaffected
        assert inner.sent[-1] == ("p", [b"c"])

    run(main())


def test_a_caller_that_gives_up_leaves_the_batch_in_flight() -> None:
    async def main() -> None:
        inner = RecordingTransport()
        inner.gate = asyncio.Event()
        transport = CoalescingTransport(inner)
        impatient = asyncio.ensure_future(transport.send("p", b"a", payload()))
        patient = asyncio.ensure_future(transport.send("p", b"b", payload()))
        await asyncio.sleep(0.05)
        impatient.cancel()
        await asyncio.sleep(0.05)
        assert not patient.done()  # the batch was not cancelled with it
        inner.gate.set()
        await patient
        assert impatient.cancelled() and inner.sent == [("p", [b"a", b"b"])]

    run(main())
