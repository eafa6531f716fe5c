"""A real local cluster for end-to-end tests: `pd-serve` as a subprocess on loopback.

The launcher is pd-bench's (`benchmarks.serve.cluster.BenchCluster`: the router's and every
node's address from pd-serve's output, node stats, a stop that reports the processes that
outlived pd-serve); this adds what only tests ask: a wait until every KV block is free.
"""

from __future__ import annotations

import time

from benchmarks.serve.cluster import BenchCluster
from pdserve.v1 import node_pb2

START_TIMEOUT_S = 300.0
POLL_S = 0.05
# Each node's KV pool unless a test sizes it: 256 MiB (~5.8K tokens of the default model)
# instead of the CPU default of 1 GiB. Every e2e prompt fits, and the clusters of parallel test
# workers fit in memory together: a default smollm2-135m node holds ~1.9 GiB RSS, one with this
# pool ~1.2 GiB (README, "Memory").
KV_CACHE_MEMORY = "256MiB"
_POOL_FLAGS = ("--kv-cache-memory", "--num-kv-blocks")


class Cluster(BenchCluster):
    def __init__(self, args: list[str]) -> None:
        if not any(a.split("=")[0] in _POOL_FLAGS for a in args):
            args = [*args, "--kv-cache-memory", KV_CACHE_MEMORY]
        super().__init__(None, args, timeout_s=START_TIMEOUT_S)

    @property
    def router(self) -> str:
        return self.address

    def start(self) -> Cluster:
        super().start()
        return self

    def wait_all_blocks_free(self, timeout_s: float) -> dict[str, node_pb2.NodeStats]:
        """Poll every node until its KV pool is entirely free; return the last stats."""
        deadline = time.monotonic() + timeout_s
        while True:
            stats = {name: self.node_stats(name) for name in self.nodes}
            if all(s.num_free_kv_blocks == s.num_kv_blocks for s in stats.values()):
                return stats
            if time.monotonic() > deadline:
                return stats
            time.sleep(POLL_S)
