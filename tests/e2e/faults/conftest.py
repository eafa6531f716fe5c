"""The fault suite's shared cluster: one set of node processes for every fault test (starting
them is the expensive part). The fault table is started afresh and printed at the end of the
run by tests/conftest.py (the process that reports, under pytest-xdist too)."""

from __future__ import annotations

import pytest

from tests.e2e.faults.fault_cluster import FaultCluster


@pytest.fixture(scope="package")
def fault_cluster(tmp_path_factory):
    """1 prefill + 2 decode nodes (small pools, 3 s transfer timeout) registered in Redis.
    A test that kills a node restarts it before it returns."""
    with FaultCluster(tmp_path_factory.mktemp("faults")) as cluster:
        cluster.start_nodes(prefill=1, decode=2)
        yield cluster
