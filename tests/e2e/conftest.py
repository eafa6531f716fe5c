from __future__ import annotations

import pytest

from tests.e2e.cluster import Cluster

MODEL = "smollm2-135m"


def _cluster(*args: str):
    cluster = Cluster(["--model", MODEL, "--device", "cpu", "--dtype", "float32", *args]).start()
    yield cluster
    leftover = cluster.stop()
    assert not leftover, f"processes left behind after Ctrl-C: {leftover}"


@pytest.fixture(scope="module")
def cluster_1p1d():
    yield from _cluster("--prefill", "1", "--decode", "1")


@pytest.fixture(scope="module")
def cluster_colocated():
    yield from _cluster("--prefill", "0", "--decode", "1")


@pytest.fixture(scope="module")
def cluster_2p2d():
    yield from _cluster("--prefill", "2", "--decode", "2")
