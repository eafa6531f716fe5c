"""A ucx connect whose peer-info exchange times out (it stalls now and then under CPU load) is
tried once more while the peer listens, and the message goes through; a dead peer's connect is
not retried, whether refused or timed out."""

from __future__ import annotations

import asyncio

import pytest
from transfer_helpers import run

from cache_transfer import TransportError, make_transport
from cache_transfer.transports import ucx_available
from tests.ports import unlistened_port

pytestmark = [
    pytest.mark.skipif(not ucx_available(), reason="ucxx does not import here"),
    pytest.mark.timeout(60),
]


class Recorder:
    def __init__(self) -> None:
        self.headers: list[bytes] = []

    def prepare(self, peer_id, header, payload_bytes):
        return None

    def complete(self, peer_id, header, payload) -> None:
        self.headers.append(header)

    def abandon(self, peer_id, header, payload) -> None:
        pass


def count_connects(monkeypatch: pytest.MonkeyPatch, first_times_out: bool) -> list[int]:
    from cache_transfer.transports.ucx import outbound

    calls: list[int] = []
    real = outbound.ucxx.create_endpoint

    async def create_endpoint(host, port, **kwargs):
        calls.append(port)
        if first_times_out and len(calls) == 1:
            raise TimeoutError  # what ucxx raises when the peer-info exchange stalls
        return await real(host, port, **kwargs)

    monkeypatch.setattr(outbound.ucxx, "create_endpoint", create_endpoint)
    return calls


def test_a_connect_that_timed_out_is_tried_again(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = count_connects(monkeypatch, first_times_out=True)

    async def scenario() -> None:
        src, dst = make_transport("ucx"), make_transport("ucx")
        recorder = Recorder()
        src.start(Recorder())
        dst.start(recorder)
        await asyncio.wait_for(src.send(dst.address, b"after a retry"), 30)
        async with asyncio.timeout(10):
            while not recorder.headers:
                await asyncio.sleep(0.01)
        assert recorder.headers == [b"after a retry"] and len(calls) == 2
        await src.close()
        await dst.close()

    run(scenario())


@pytest.mark.parametrize("times_out", [False, True], ids=["refused", "timed-out"])
def test_a_dead_peer_is_not_retried(monkeypatch: pytest.MonkeyPatch, times_out: bool) -> None:
    """Refused at once, or (ucxx waiting out its exchange) timed out: nothing listens on the
    port, so no second attempt."""
    calls = count_connects(monkeypatch, first_times_out=times_out)

    async def scenario(port: int) -> None:
        src = make_transport("ucx")
        src.start(Recorder())
        with pytest.raises(TransportError, match="cannot connect"):
            await asyncio.wait_for(src.send(f"ucx://127.0.0.1:{port}", b"x"), 30)
        assert len(calls) == 1
        await src.close()

    with unlistened_port() as port:  # held: nothing can start to listen there meanwhile
        run(scenario(port))
