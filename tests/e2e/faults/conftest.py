"""The fault suite's shared cluster (one set of node processes for every fault test: starting
them is the expensive part) and the fault table printed at the end of the run."""

from __future__ import annotations

import pytest

from tests.e2e.faults.fault_cluster import FaultCluster
from tests.e2e.faults.table import read_rows, render, reset, table_path


@pytest.fixture(scope="session", autouse=True)
def _fresh_fault_table():
    """Each pytest run starts the table afresh."""
    reset()


def pytest_terminal_summary(terminalreporter) -> None:
    rows = read_rows()
    if rows:
        terminalreporter.section(f"fault table ({table_path()})")
        terminalreporter.write_line(render(rows))


@pytest.fixture(scope="package")
def fault_cluster(tmp_path_factory):
    """1 prefill + 2 decode nodes (small pools, 3 s transfer timeout) registered in Redis.
    A test that kills a node restarts it before it returns."""
    with FaultCluster(tmp_path_factory.mktemp("faults")) as cluster:
        cluster.start_nodes(prefill=1, decode=2)
        yield cluster
