"""Served nodes with async scheduling (the default on CUDA; on CPU asked for with
`--async-scheduling on`): a 1P1D and a colocated cluster give the offline engine's tokens, and a
stream cancelled while steps run ahead frees every block."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import REAL_MODEL_CLUSTERS, _cluster
from tests.e2e.test_serving import (  # noqa: F401 (offline_reference: a fixture)
    cancel_mid_stream,
    greedy,
    offline_reference,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), REAL_MODEL_CLUSTERS]


@pytest.fixture(scope="module")
def cluster_1p1d_async():
    yield from _cluster("--prefill", "1", "--decode", "1", "--async-scheduling", "on")


@pytest.fixture(scope="module")
def cluster_colocated_async():
    yield from _cluster("--prefill", "0", "--decode", "1", "--async-scheduling", "on")


def engine_lines(cluster) -> list[str]:
    return [line for line in cluster.log if "engine ready" in line]


def test_async_nodes_equal_offline(cluster_1p1d_async, cluster_colocated_async, offline_reference):  # noqa: F811
    expected, _ = offline_reference
    # the decode engines run ahead; the prefill role never does, whatever the flag
    lines = engine_lines(cluster_1p1d_async)
    assert sum("async_scheduling=True" in line for line in lines) == 1, lines
    assert sum("async_scheduling=False" in line for line in lines) == 1, lines
    assert any("async_scheduling=True" in line for line in engine_lines(cluster_colocated_async))
    for cluster in (cluster_1p1d_async, cluster_colocated_async):
        assert [r.token_ids for r in greedy(cluster.router)] == expected
        stats = cluster.wait_all_blocks_free(timeout_s=5)
        assert all(s.num_free_kv_blocks == s.num_kv_blocks for s in stats.values()), stats


def test_cancel_while_steps_run_ahead_frees_the_blocks(cluster_1p1d_async):
    cancel_mid_stream(cluster_1p1d_async)
    stats = cluster_1p1d_async.wait_all_blocks_free(timeout_s=5)
    decode = stats["decode-0"]
    assert decode.num_free_kv_blocks == decode.num_kv_blocks, decode
