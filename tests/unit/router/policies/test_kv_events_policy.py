"""The kv_events policy (router/policies/kv_events.py): the exact per-node index, picks by the
longest prefix held against load, and the watchers that feed the index from each node's
WatchKVEvents stream (snapshot first, then batches; a broken stream, a seq gap or a restart
start the node over from a fresh snapshot; nodes no longer followed are forgotten)."""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace

import grpc
import pytest

from pdserve.block_hash import block_hashes, root_hash
from pdserve.v1 import node_pb2
from router.policies import KVEventsPolicy, make_policy
from router.policies.kv_event_index import IndexOverflow, KVEventIndex
from router.policies.kv_event_watchers import KVEventWatchers
from tests.unit.router.policies.test_policies import BLOCK_SIZE, node, request

ROOT = root_hash("")


def digest(i: int) -> bytes:
    return i.to_bytes(32, "big")


def test_index_tracks_each_node_exactly() -> None:
    index = KVEventIndex(max_hashes_per_node=4)
    index.apply("a", [digest(1), digest(2), digest(3)], [])
    index.apply("b", [digest(1), digest(2), b"short"], [])  # not a digest: skipped
    index.apply("b", [], [digest(2), digest(9)])  # removing what it never held: ignored
    hashes = [digest(1), digest(2), digest(3), digest(4)]
    assert index.prefix_blocks(hashes, ["a", "b", "c"]) == {"a": 3, "b": 1, "c": 0}
    index.reset("a")
    assert index.prefix_blocks(hashes, ["a", "b"]) == {"a": 0, "b": 1}
    with pytest.raises(IndexOverflow):
        index.apply("b", [digest(i) for i in range(10, 14)], [])
    assert index.num_held("b") == 0 and index.prefix_blocks(hashes, ["b"]) == {"b": 0}
    index.forget("a")
    assert index._holders == {}


def held_by(policy: KVEventsPolicy, address: str, tokens: list[int]) -> None:
    policy.index.apply(address, block_hashes(tokens, BLOCK_SIZE, ROOT), [])


def test_picks_the_nodes_holding_the_longest_prefix_unless_much_busier() -> None:
    policy = make_policy("kv_events")
    assert isinstance(policy, KVEventsPolicy)
    conversation = list(range(3, 3 + 64))  # 16 blocks
    prefill, decode = [node("p0"), node("p1")], [node("d0"), node("d1")]
    held_by(policy, "p1", conversation[:40])
    held_by(policy, "d0", conversation[:60])
    held_by(policy, "d1", conversation[:8])
    turn = request(conversation + [7, 8, 9])
    for _ in range(3):  # not a tie: no rotation
        route = policy.pick(turn, prefill, decode)
        assert (route.prefill.address, route.decode.address) == ("p1", "d0")
    assert policy.held_tokens(turn, decode) == {"d0": 60, "d1": 8}
    busy = [node("p0"), node("p1", num_queued_prefill_tokens=100, num_free_kv_blocks=64)]
    assert policy.pick(turn, busy, decode).prefill.address == "p0"  # 67 + 0 < 27 + 100
    full = [node("d0", num_free_kv_blocks=0), node("d1", num_free_kv_blocks=64)]
    assert policy.pick(turn, prefill, full).decode.address == "d1"  # d0 has no room
    # the last token is always computed: a prompt wholly held counts one block less
    whole = request(conversation[:60])
    assert policy.held_tokens(whole, decode)["d0"] == 56


def test_a_local_prefill_goes_to_the_decode_node_holding_it() -> None:
    policy = make_policy("kv_events", local_prefill_max_tokens=1000)
    conversation = list(range(3, 3 + 32))
    held_by(policy, "d1", conversation)
    route = policy.pick(request(conversation + [5]), [node("p0")], [node("d0"), node("d1")])
    assert route.prefill is None and route.decode.address == "d1"


IDLE = object()  # in a script: the stream stays open, silent


class FakeNode:
    """A NodeClient whose WatchKVEvents streams play scripts: each call takes the next one
    (a list of KVEvents, then an optional exception or IDLE); past the last, a stream that
    idles."""

    def __init__(self, address: str, scripts: list[list]) -> None:
        self.address = address
        self.scripts = scripts
        self.calls = 0
        self.node_stub = SimpleNamespace(WatchKVEvents=self._watch)

    def _watch(self, request):
        self.calls += 1
        script = self.scripts.pop(0) if self.scripts else None
        return FakeCall(script)


class FakeCall:
    def __init__(self, script) -> None:
        self.script = script

    def cancel(self) -> None:
        pass

    async def __aiter__(self):
        if self.script is None:
            await asyncio.sleep(3600)
        for item in self.script:
            if isinstance(item, BaseException):
                raise item
            if item is IDLE:
                await asyncio.sleep(3600)
            yield item


def events(seq: int, epoch: str = "e1", reset: bool = False, stored=(), removed=()):
    return node_pb2.KVEvents(
        epoch=epoch, seq=seq, reset=reset, stored=[digest(i) for i in stored],
        removed=[digest(i) for i in removed],
    )  # fmt: skip


def broken() -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, None, None, "connection lost")


async def until(condition, timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.005)


def test_watchers_rebuild_the_index_after_a_gap_a_break_and_a_restart() -> None:
    async def main() -> None:
        index = KVEventIndex()
        hashes = [digest(i) for i in range(1, 6)]
        node = FakeNode("n", [
            [events(1, reset=True, stored=[1, 2]), events(2, stored=[3]), events(4, stored=[4])],
            [events(1, reset=True, stored=[1, 2, 3]), events(2, removed=[3]), broken()],
            [events(1, reset=True, stored=[1]), events(2, epoch="e2", stored=[2])],
            [events(1, epoch="e3", reset=True, stored=[1, 2, 3, 4]), IDLE],  # a restarted node
        ])  # fmt: skip
        watchers = KVEventWatchers(index, retry_s=0.01)
        watchers.follow([node])
        await until(lambda: node.calls == 4 and index.num_held("n") == 4)
        assert index.prefix_blocks(hashes, ["n"]) == {"n": 4}
        assert watchers.epochs == {"n": "e3"}
        watchers.follow([])  # the node left the registry
        assert index.num_held("n") == 0 and watchers.watched == []
        await watchers.close()

    asyncio.run(main())


def test_a_stream_that_does_not_start_with_a_snapshot_is_refused() -> None:
    async def main() -> None:
        index = KVEventIndex()
        node = FakeNode("n", [[events(1, stored=[1])], [events(1, reset=True, stored=[2]), IDLE]])
        watchers = KVEventWatchers(index, retry_s=0.01)
        watchers.follow([node])
        await until(lambda: node.calls == 2 and index.num_held("n") == 1)
        assert index.prefix_blocks([digest(1)], ["n"]) == {"n": 0}
        assert index.prefix_blocks([digest(2)], ["n"]) == {"n": 1}
        await watchers.close()

    asyncio.run(main())


def test_prepare_hashes_a_long_prompt_once_off_the_loop(monkeypatch) -> None:
    import router.policies.kv_events as kv_events

    monkeypatch.setattr(kv_events, "OFF_LOOP_TOKENS", 16)
    threads = []
    real = asyncio.to_thread

    async def spy(fn, *args):
        threads.append(fn)
        return await real(fn, *args)

    monkeypatch.setattr(kv_events.asyncio, "to_thread", spy)
    policy = make_policy("kv_events")
    long_request = request(list(range(3, 43)))

    async def main() -> None:
        await policy.prepare(long_request, BLOCK_SIZE)
        await policy.prepare(request(list(range(3, 10))), BLOCK_SIZE)  # short: nothing

    asyncio.run(main())
    assert len(threads) == 1
    cached = long_request._block_hashes[(BLOCK_SIZE, policy.root_hash)]
    assert long_request.block_hashes(BLOCK_SIZE, policy.root_hash) is cached  # not again


def test_a_tenants_prompt_matches_only_its_own_namespace() -> None:
    """Nodes root a salted request's hashes in its cache salt (router.tenancy): so does the
    index lookup; the same tokens of another tenant match nothing."""
    policy = make_policy("kv_events", prefix_cache_salt="deploy")
    tokens = list(range(3, 3 + 32))
    tenant_a = root_hash("deploy", "tenant-a")
    policy.index.apply("d1", block_hashes(tokens, BLOCK_SIZE, tenant_a), [])
    mine = dataclasses.replace(request(tokens + [5]), cache_salt="tenant-a")
    theirs = dataclasses.replace(request(tokens + [5]), cache_salt="tenant-b")
    nodes = [node("d0"), node("d1")]
    assert policy.held_tokens(mine, nodes) == {"d0": 0, "d1": 32}
    assert policy.held_tokens(theirs, nodes) == {"d0": 0, "d1": 0}
