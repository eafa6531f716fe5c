"""`Node.WatchKVEvents` on a real decode node (KVEventHub): a watcher's copy, built from the
snapshot and the batches after it, equals the hashes the engine caches; a second watcher gets
its own snapshot; a snapshot larger than a message spans several; a watcher that falls behind
is resynced with a snapshot; the node's stop ends every watch at once."""

from __future__ import annotations

import asyncio

import pytest

from engine.kv_events import KVEventBatch
from node_common import kv_event_hub
from node_common.kv_event_hub import KVEventHub
from pdserve.v1 import node_pb2
from tests.unit.decode_node.node_harness import (
    RPC_TIMEOUT_S,
    Nodes,
    prompt,
    run,
    run_local,
    running_nodes,
)

pytestmark = pytest.mark.timeout(120)


class Watcher:
    """Reads a WatchKVEvents stream in the background into a copy of the node's hashes."""

    def __init__(self, nodes: Nodes) -> None:
        self.call = nodes.decode_node_stub.WatchKVEvents(node_pb2.WatchKVEventsRequest())
        self.held: set[bytes] = set()
        self.messages: list[node_pb2.KVEvents] = []
        self.task = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        async for message in self.call:
            assert message.seq == len(self.messages) + 1  # no gap
            assert message.reset or self.messages, "the first message starts a snapshot"
            self.messages.append(message)
            if message.reset:
                self.held.clear()
            self.held |= set(message.stored)
            self.held -= set(message.removed)

    async def equals(self, nodes: Nodes) -> None:
        """Within a few polls, the copy equals what the decode engine caches (device tier)."""
        async with asyncio.timeout(RPC_TIMEOUT_S):
            while self.held != set(nodes.decode.core.kv_cache_manager._cached):
                await asyncio.sleep(0.01)

    async def close(self) -> None:
        self.call.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


def test_a_watchers_copy_follows_the_cache() -> None:
    async def main() -> None:
        async with running_nodes("local") as nodes:
            await run_local(nodes, "a", prompt(30, seed=1))  # cached before anyone watched
            first = Watcher(nodes)
            await first.equals(nodes)
            assert first.messages[0].reset and first.held
            await run_local(nodes, "b", prompt(40, seed=2))
            await first.equals(nodes)
            second = Watcher(nodes)
            await second.equals(nodes)
            assert await nodes.decode.engine.reset_prefix_cache()  # every hash removed
            await first.equals(nodes)
            await second.equals(nodes)
            assert first.held == set() and first.messages[-1].removed
            assert {m.epoch for m in first.messages} == {nodes.decode.kv_events.epoch}
            await first.close()
            await second.close()

    run(main())


class FakeEngine:
    """An AsyncEngine's kv_events: a held set that tests change between polls."""

    def __init__(self) -> None:
        self.held: set[bytes] = set()
        self.batch = KVEventBatch()

    async def kv_events(self, snapshot: bool = False):
        batch, self.batch = self.batch, KVEventBatch()
        return batch, sorted(self.held) if snapshot else None

    def store(self, *hashes: bytes) -> None:
        self.held |= set(hashes)
        self.batch = KVEventBatch(stored=[*self.batch.stored, *hashes])


def test_snapshots_span_messages_and_a_slow_watcher_is_resynced(monkeypatch) -> None:
    monkeypatch.setattr(kv_event_hub, "MAX_HASHES_PER_MESSAGE", 3)
    monkeypatch.setattr(kv_event_hub, "MAX_QUEUED", 2)

    async def main() -> None:
        engine = FakeEngine()
        engine.held = {bytes([i]) for i in range(7)}
        hub = KVEventHub(engine, poll_s=0.001)  # type: ignore[arg-type]
        stream = hub.watch()
        first = [await anext(stream) for _ in range(3)]  # 7 hashes: 3 + 3 + 1
        assert [m.reset for m in first] == [True, False, False]
        assert [m.seq for m in first] == [1, 2, 3]
        assert set().union(*(m.stored for m in first)) == engine.held
        for i in range(6):  # the watcher reads nothing meanwhile: it falls behind
            engine.store(bytes([100 + i]))
            await asyncio.sleep(0.02)
        copy, resets = set(first[0].stored), 0
        async with asyncio.timeout(5):
            while copy != engine.held:
                message = await anext(stream)
                if message.reset:
                    copy, resets = set(), resets + 1
                copy = (copy | set(message.stored)) - set(message.removed)
        assert resets == 1 and message.seq > 3  # the batches it missed: one snapshot instead
        hub.close()
        with pytest.raises(StopAsyncIteration):
            async with asyncio.timeout(5):
                while True:
                    await anext(stream)

    run(main())


def test_stopping_the_node_ends_every_watch() -> None:
    async def main() -> None:
        async with running_nodes("local", check_free=False) as nodes:
            watcher = Watcher(nodes)
            await watcher.equals(nodes)
            loop = asyncio.get_running_loop()
            start = loop.time()
            await nodes.decode.stop(grace_s=30.0)  # would wait 30 s for an open stream
            assert loop.time() - start < 10.0
            await asyncio.wait_for(asyncio.gather(watcher.task, return_exceptions=True), 10)

    run(main())
