"""The rank link between a tensor-parallel node's rank 0 and another rank: only a peer with
the key is heard; calls are answered (or fail with the handler's error); notes go one way;
the other end going away fails pending calls at once and sets `closed`; a frame over the cap
is refused before it is read."""

from __future__ import annotations

import asyncio
import struct

import pytest

from node_common.tp.rank_link import MAX_FRAME_BYTES, LinkClosed, LinkServer, connect_link

pytestmark = pytest.mark.timeout(60)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


async def _pair(worker_handler, rank0_handler=None):
    server = LinkServer(worker_handler, "rank 1 link")
    await server.start()

    async def nothing(message):
        return None

    link = await connect_link(server.path, server.key, rank0_handler or nothing, "rank 0 side")
    await asyncio.wait_for(server.connected.wait(), 5)
    return server, link


def test_calls_are_answered_notes_arrive_and_errors_come_back():
    async def main():
        heard = []

        async def worker(message):
            heard.append(message)
            if message == "boom":
                raise ValueError("no such thing")
            return {"echo": message}

        reports = asyncio.Queue()

        async def rank0(message):
            reports.put_nowait(message)

        server, link = await _pair(worker, rank0)
        try:
            assert await link.call("hello", 5) == {"echo": "hello"}
            link.note("one way")
            with pytest.raises(RuntimeError, match="no such thing"):
                await link.call("boom", 5)
            assert heard == ["hello", "one way", "boom"]
            server.link.note("done: ok")  # the worker's report
            assert await asyncio.wait_for(reports.get(), 5) == "done: ok"
        finally:
            await link.close()
            await server.close()

    run(main())


def test_a_peer_without_the_key_is_not_heard():
    async def main():
        async def worker(message):
            raise AssertionError("heard a peer without the key")

        server = LinkServer(worker, "rank 1 link")
        await server.start()
        try:
            intruder = await connect_link(server.path, b"x" * 32, worker, "intruder")
            await asyncio.wait_for(intruder.closed.wait(), 5)  # the worker hung up
            with pytest.raises(LinkClosed):
                await intruder.call("hello", 1)
            assert server.link is None
        finally:
            await server.close()

    run(main())


def test_the_other_end_going_away_fails_pending_calls_at_once():
    async def main():
        async def slow(message):
            await asyncio.sleep(60)

        server, link = await _pair(slow)
        call = asyncio.ensure_future(link.call("wait forever", 30))
        await asyncio.sleep(0.1)
        await server.close()  # the rank died
        with pytest.raises(LinkClosed):
            await asyncio.wait_for(call, 5)
        assert link.closed.is_set()
        await link.close()

    run(main())


def test_an_oversized_frame_closes_the_link_before_it_is_read():
    async def main():
        async def worker(message):
            return None

        server = LinkServer(worker, "rank 1 link")
        await server.start()
        try:
            reader, writer = await asyncio.open_unix_connection(server.path)
            writer.write(server.key + struct.pack("!I", MAX_FRAME_BYTES + 1))
            await writer.drain()
            await asyncio.wait_for(server.connected.wait(), 5)
            await asyncio.wait_for(server.link.closed.wait(), 5)
            writer.close()
        finally:
            await server.close()

    run(main())
