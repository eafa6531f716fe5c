"""The KV hand-off between tensor-parallel sizes, end to end on CPU (gloo) over tcp and ucx:
prefill TP 2 -> decode TP 1, TP 1 -> TP 2 and TP 2 -> TP 2 give exactly the greedy tokens of a
colocated TP 1 node (TP 1 -> TP 1, today's hand-off, too), every request's KV came from the
prefill node (no fallback), and afterwards every node's pool is whole and no rank of any node
holds a hand-off (the leak check on every rank); stopped (SIGTERM), every node exits 0 and no
process of any rank is left."""

from __future__ import annotations

import asyncio

import psutil
import pytest

from cache_transfer.transports import ucx_available
from tests.e2e.tp_cluster import TPNodes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TRANSPORTS = [
    pytest.param(
        "ucx", marks=pytest.mark.skipif(not ucx_available(), reason="ucxx does not import here")
    ),
    "tcp",
]
NODES = {
    "prefill-tp1": ("prefill", 1),
    "prefill-tp2": ("prefill", 2),
    "decode-tp1": ("decode", 1),
    "decode-tp2": ("decode", 2),
}
# block size 4, 16 tokens a step: the longest prompts prefill in chunks
PROMPTS = [
    [5, 17, 33],
    [9, 4, 120, 77, 301, 2, 45, 8],
    [(7 * i + 3) % 500 for i in range(23)],
    [(11 * i + 1) % 500 for i in range(41)],
]
PAIRS = [
    ("prefill-tp2", "decode-tp1"),
    ("prefill-tp1", "decode-tp2"),
    ("prefill-tp2", "decode-tp2"),
    ("prefill-tp1", "decode-tp1"),
]


@pytest.fixture(scope="module", params=TRANSPORTS)
def tp_nodes(request: pytest.FixtureRequest):
    with TPNodes(request.param) as nodes:
        nodes.start(NODES)
        yield nodes


def test_every_pair_of_sizes_equals_colocated_tp1(tp_nodes):
    async def main():
        reference = await tp_nodes.generate(PROMPTS, decode="decode-tp1")
        results = {}
        for prefill, decode in PAIRS:
            results[prefill, decode] = await tp_nodes.generate(
                PROMPTS, prefill=prefill, decode=decode
            )
        return reference, results

    reference, results = asyncio.run(asyncio.wait_for(main(), 300))
    assert all(len(tokens) == 8 for tokens in reference)
    for pair, tokens in results.items():
        assert tokens == reference, pair
    stats = tp_nodes.drained()
    for name in ("decode-tp1", "decode-tp2"):  # every hand-off landed: no local prefill
        assert stats[name].num_failed_transfers == 0, (name, stats[name])
    assert stats["decode-tp2"].num_local_prefills == 0
    assert stats["decode-tp1"].num_local_prefills == len(PROMPTS)  # the colocated reference
    for name, node in stats.items():  # every rank: nothing held
        assert node.num_free_kv_blocks == node.num_kv_blocks, (name, node)
        assert node.num_pending_transfers == 0, (name, node)


def test_stopped_nodes_leave_no_rank_behind(tp_nodes):
    processes = [p for name in NODES for p in tp_nodes.ranks(name)]
    assert len(processes) == sum(tp for _, tp in NODES.values())
    codes = tp_nodes.stop()
    assert codes == dict.fromkeys(NODES, 0), codes
    psutil.wait_procs(processes, timeout=30)
    assert not [p.pid for p in processes if p.is_running() and p.status() != "zombie"]
