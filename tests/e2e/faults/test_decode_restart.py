"""A decode node killed and restarted on its old ports: the prefill node's connection to the
old process is stale (ucx: "not connected"; tcp: zmq reconnects on its own). The first
hand-off after the restart fails on P's side, P reports it, and the router cancels D's
reservation at once: the request finishes in well under the 30 s transfer timeout (before the
fix it waited it out, per request), and later hand-offs reconnect and succeed."""

from __future__ import annotations

import asyncio
import time

import pytest

from cache_transfer.transports import ucx_available
from tests.e2e.faults.fault_cluster import FaultCluster
from tests.e2e.faults.fault_tools import run_one
from tests.e2e.registry_cluster import eventually

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

TRANSFER_TIMEOUT_S = 30.0
FAST_S = 10.0
TRANSPORTS = [
    pytest.param(
        "ucx", marks=pytest.mark.skipif(not ucx_available(), reason="ucxx does not import here")
    ),
    "tcp",
]


async def requests(cluster, num: int, seed: int):
    async with cluster.router(transfer_timeout_s=TRANSFER_TIMEOUT_S) as (router, client):
        registry = router.registry
        await eventually(
            lambda: len(registry.prefill_nodes) == 1 and len(registry.decode_nodes) == 1, 30
        )
        outcomes = []
        for i in range(num):  # one at a time: each meets the connection as the last left it
            ids = [seed + i, 6, 7, 8, 9, 10, 11, 12]
            outcomes.append(await run_one(client, 60.0, prompt_token_ids=ids, max_tokens=4,
                                          temperature=0.0, ignore_eos=True))  # fmt: skip
        return outcomes, router.stats.num_prefill_failures


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_decode_restarted_on_its_ports(tmp_path, monkeypatch, transport):
    # Rebinding a ucx port whose old connections sit in TIME_WAIT needs SO_REUSEADDR
    # (UCX_CM_REUSEADDR): the restart itself is the listener's own regression test (the
    # security/restart work makes it the default); this test is about the stale connection.
    monkeypatch.setenv("UCX_CM_REUSEADDR", "y")
    with FaultCluster(tmp_path) as cluster:
        flags = dict(kv_transport=transport, transfer_timeout_s=TRANSFER_TIMEOUT_S,
                     bind_retry_s=30)  # old ports may linger (within LAUNCH_TIMEOUT_S)  # fmt: skip
        cluster.start_nodes(decode=1, **flags)  # on ports it picks and binds itself
        cluster.start_nodes(prefill=1, **flags)
        before, _ = asyncio.run(requests(cluster, 2, seed=5))
        assert cluster.stats("decode-0").num_failed_transfers == 0
        cluster.kill("decode-0")
        cluster.restart("decode-0", same_ports=True)  # (it retries a port still held)
        start = time.monotonic()
        after, num_prefill_failures = asyncio.run(requests(cluster, 3, seed=50))
        elapsed_s = time.monotonic() - start
        stats = cluster.stats("decode-0")
        cluster.check(f"decode restarted on its ports ({transport}): stale P->D connection",
                      before + after, ["prefill-0", "decode-0"], 60.0,
                      notes=f"failed hand-offs after={stats.num_failed_transfers}; "
                            f"{elapsed_s:.1f} s for 3", min_completed=5)  # fmt: skip
        assert all(o.elapsed_s < FAST_S for o in after), [o.elapsed_s for o in after]
        # a failed hand-off is P's report relayed by the router, never D waiting it out
        assert stats.num_failed_transfers == num_prefill_failures
        assert stats.num_local_prefills == stats.num_failed_transfers  # the rest went through P
        assert stats.num_failed_transfers < len(after)  # P reconnected: hand-offs work again
