"""Served nodes with speculative decoding (prompt lookup): a colocated cluster (the decode node
prefills locally, then verifies drafts) and a 1P1D one (the decode node drafts after the first
token it received) give the offline engine's greedy tokens and free every block."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import _cluster
from tests.e2e.test_serving import (  # noqa: F401 (offline_reference: a fixture)
    greedy,
    offline_reference,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
SPEC = ("--speculative-method", "ngram", "--num-speculative-tokens", "4")


@pytest.fixture(scope="module")
def cluster_1p1d_spec():
    yield from _cluster("--prefill", "1", "--decode", "1", *SPEC)


@pytest.fixture(scope="module")
def cluster_colocated_spec():
    yield from _cluster("--prefill", "0", "--decode", "1", *SPEC)


def test_speculating_nodes_equal_offline(
    cluster_1p1d_spec,
    cluster_colocated_spec,
    offline_reference,  # noqa: F811
):
    expected, _ = offline_reference
    for cluster in (cluster_colocated_spec, cluster_1p1d_spec):
        assert any("speculative=ngram K=4" in line for line in cluster.log)
        assert [r.token_ids for r in greedy(cluster.router)] == expected
        stats = cluster.wait_all_blocks_free(timeout_s=5)
        assert all(s.num_free_kv_blocks == s.num_kv_blocks for s in stats.values()), stats
