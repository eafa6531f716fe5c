"""Routing from KV events end to end (issue 38): 2 prefill + 2 decode node processes with a
cluster secret (so received KV is cached and reused), registered in a real Redis, and an
in-process router with --policy kv_events watching every node's WatchKVEvents stream.

A conversation's turns go to the prefill and decode nodes that hold its earlier turns, as the
router's exact index shows them; after its blocks are evicted from its decode node (a flood of
other prompts there) the index shows it, and the next turn still completes; after that decode
node is killed and another started, the index forgets the dead node and the conversation
settles on the node that holds it again.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from pdserve.block_hash import block_hashes
from pdserve.config import SecurityConfig
from pdserve.grpc_security import open_channel
from pdserve.security import load_cluster_auth
from pdserve.v1 import node_pb2, node_pb2_grpc
from router.server import RouterServer
from tests.e2e.registry_cluster import BLOCK_SIZE, RegistryCluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

TEST_TIMEOUT_S = 240.0
NUM_KV_BLOCKS = 128  # 512 tokens per node: a flood of a few prompts evicts everything
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    folder: Path = tmp_path_factory.mktemp("kv-events")
    secret = folder / "secret"
    secret.write_text("kv-events-cluster-secret-0123456789\n")
    with RegistryCluster(folder) as cluster:
        cluster.start_nodes(
            prefill=2, decode=2, cluster_secret_file=secret, num_kv_blocks=NUM_KV_BLOCKS
        )
        yield cluster, SecurityConfig(cluster_secret_file=str(secret))


class Conversation:
    """A chat: each turn's prompt is the previous prompt, its answer and a new message."""

    def __init__(self, seed: int, first_len: int = 40) -> None:
        self.rng = random.Random(seed)
        self.prompt = self.tokens(first_len)

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(3, 512) for _ in range(n)]

    async def turn(self, router: RouterServer, client) -> tuple[str, str]:
        """Send the next turn; the (prefill, decode) addresses it was routed to."""
        before = dict(router.stats.requests_routed)
        result = await client.generate_all(
            prompt_token_ids=self.prompt, max_tokens=MAX_TOKENS, temperature=0.0,
            ignore_eos=True, timeout_s=60,
        )  # fmt: skip
        assert len(result.token_ids) == MAX_TOKENS
        routed = {a for a, n in router.stats.requests_routed.items() if n > before.get(a, 0)}
        self.prompt = self.prompt + list(result.token_ids) + self.tokens(12)
        prefill = [a for a in routed if _is(router, a, node_pb2.NODE_ROLE_PREFILL)]
        decode = [a for a in routed if _is(router, a, node_pb2.NODE_ROLE_DECODE)]
        assert len(prefill) == 1 and len(decode) == 1, routed
        return prefill[0], decode[0]


def _is(router: RouterServer, address: str, role: int) -> bool:
    return any(n.address == address and n.info.role == role for n in router.registry.ready_nodes)


def held(router: RouterServer, conversation: Conversation, address: str) -> int:
    """Leading blocks of the conversation's next prompt `address` holds, as the router sees."""
    policy = router.policy
    hashes = block_hashes(conversation.prompt, BLOCK_SIZE, policy.root_hash)
    return policy.index.prefix_blocks(hashes, [address])[address]


async def until(predicate, timeout_s: float = 30.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.05)


async def flood(address: str, security: SecurityConfig, seed: int) -> None:
    """Local prefills on one decode node that need its whole pool (evicting its cache)."""
    channel = open_channel(address, security, load_cluster_auth(security))
    stub = node_pb2_grpc.DecodeNodeStub(channel)
    rng = random.Random(seed)
    try:
        for i in range(3):
            request = node_pb2.DecodeRequest(
                request_id=f"flood-{seed}-{i}", mode=node_pb2.DECODE_MODE_LOCAL_PREFILL,
                prompt_token_ids=[rng.randrange(3, 512) for _ in range(NUM_KV_BLOCKS * 3)],
                sampling=node_pb2.NodeSamplingParams(max_tokens=4, ignore_eos=True),
            )  # fmt: skip
            async for _ in stub.Decode(request, timeout=60):
                pass
    finally:
        await channel.close()


def test_turns_follow_the_nodes_that_hold_them(secured) -> None:
    cluster, security = secured

    async def body() -> None:
        async with cluster.router(policy="kv_events", security=security) as (router, client):
            await until(lambda: len(router.policy.watchers.epochs) == 4)
            chat = Conversation(seed=1)
            prefill, decode = await chat.turn(router, client)
            for _ in range(2):  # the router's index learns where turn k went, then turn k+1
                await until(lambda: held(router, chat, decode) > 0 and held(router, chat, prefill))
                assert (prefill, decode) == await chat.turn(router, client)

            # forced evictions: the decode node's pool is flooded; the index sees the blocks go
            await flood(decode, security, seed=7)
            await until(lambda: held(router, chat, decode) == 0)
            prefill, decode = await chat.turn(router, client)
            await until(lambda: held(router, chat, decode) > 0)
            assert (prefill, decode) == await chat.turn(router, client)

            # a restart: the decode node holding it dies, another one starts
            name = next(n for n, p in cluster.nodes.items() if p.address == decode)
            cluster.kill(name)
            await until(lambda: decode not in router.policy.watchers.epochs)
            assert router.policy.index.num_held(decode) == 0
            (new_name,) = await asyncio.to_thread(
                cluster.start_nodes, decode=1, cluster_secret_file=security.cluster_secret_file,
                num_kv_blocks=NUM_KV_BLOCKS,
            )  # fmt: skip
            new = cluster.address(new_name)
            await until(lambda: new in router.policy.watchers.epochs, timeout_s=60)
            prefill, decode = await chat.turn(router, client)
            await until(lambda: held(router, chat, decode) > 0)
            assert (prefill, decode) == await chat.turn(router, client)

    asyncio.run(asyncio.wait_for(body(), TEST_TIMEOUT_S))
