"""Issue 39, item 9 (regression): a secured cluster's prefill node stopped (SIGSTOP) while
three long requests are in flight. The decode node's per-caller cap must see callers: the
router proves the cluster secret, so its requests are measured against the pool's free blocks,
not against --max-pending-kv-share. All three complete; none is refused while the pool holds
them. Before, the third was refused RESOURCE_EXHAUSTED ("this caller ... holds ... blocks")
with the pool a quarter free.

The issue's scenario, scaled down (its meaning kept): 3 x 100 tokens (26 blocks each, 78 of a
96-block pool: over the default 0.75 share of 72, within the pool), the prefill node stopped for
8 s instead of 15 (longer than the decode node's 2 s queue timeout, shorter than the router's
AttachTicket deadline of 6 s plus the hand-off's), its own cluster of real processes."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.config import RouterConfig, SecurityConfig
from pdserve.security import AUTH_METADATA_KEY, ClusterAuth
from pdserve.v1 import node_pb2, node_pb2_grpc
from tests.e2e.faults.fault_cluster import FaultCluster
from tests.e2e.faults.fault_tools import burst, prompts
from tests.e2e.registry_cluster import RPC_TIMEOUT_S, serving_router

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SECRET = b"a-cluster-secret-0123456789abcdef"
STOPPED_S = 8.0
DEADLINE_S = 60.0
PROMPT_LEN = 100  # tokens: 26 blocks of 4 with the first output token


class SecuredFaultCluster(FaultCluster):
    """A FaultCluster whose nodes hold a cluster secret (its stats calls prove it)."""

    def __init__(self, folder) -> None:
        super().__init__(folder)
        self.secret_file = folder / "cluster-secret"
        self.secret_file.write_bytes(SECRET + b"\n")
        self.auth = ClusterAuth(SECRET)

    def stats(self, name: str) -> node_pb2.NodeStats:
        address = self.address(name)
        proof = self.auth.call_token("/pdserve.v1.Node/GetStats", address)
        with grpc.insecure_channel(address) as channel:
            stub = node_pb2_grpc.NodeStub(channel)
            return stub.GetStats(node_pb2.GetStatsRequest(), timeout=RPC_TIMEOUT_S,
                                 metadata=((AUTH_METADATA_KEY, proof),))  # fmt: skip


def test_a_stopped_prefill_node_with_three_long_requests_in_flight(tmp_path) -> None:
    with SecuredFaultCluster(tmp_path) as cluster:
        security = SecurityConfig(cluster_secret_file=str(cluster.secret_file))
        cluster.start_nodes(
            prefill=1, decode=1, cluster_secret_file=cluster.secret_file, queue_timeout_s=2.0,
            transfer_timeout_s=30.0, max_pending_kv_share=0.75,
        )  # fmt: skip
        config = RouterConfig(
            port=0, http_port=0, grace_s=0.0, node_wait_s=20.0, security=security,
            prefill_addrs=(cluster.address("prefill-0"),),
            decode_addrs=(cluster.address("decode-0"),),
            node_rpc_timeout_s=6.0, transfer_timeout_s=30.0,
        )  # fmt: skip

        async def main():
            async with serving_router(config) as (router, client):
                cluster.freeze("prefill-0")
                try:
                    loop = asyncio.get_running_loop()
                    loop.call_later(STOPPED_S, cluster.thaw, "prefill-0")
                    ids = prompts(3, seed=39, min_len=PROMPT_LEN, max_len=PROMPT_LEN)
                    return await burst(client, ids, DEADLINE_S, max_tokens=8)
                finally:
                    cluster.thaw("prefill-0")

        outcomes = asyncio.run(main())
        cluster.check(
            f"prefill stopped {STOPPED_S:g} s, 3 long requests, secured (per-caller cap)",
            outcomes, ["prefill-0", "decode-0"], DEADLINE_S, allowed=frozenset(),
            min_completed=len(outcomes),
        )  # fmt: skip
