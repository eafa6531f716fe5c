from __future__ import annotations

import pytest

from tests.e2e.cluster import Cluster
from tests.e2e.observe import free_ports, http_url, metrics_urls

MODEL = "smollm2-135m"
# Prompts of at most this many tokens are prefilled on the decode node (the HTTP cluster's
# local-prefill route); longer ones go through the prefill node.
HTTP_LOCAL_PREFILL_MAX_TOKENS = 2


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


@pytest.fixture(scope="module")
def cluster_http():
    """1P1D with the OpenAI HTTP API and every node's /metrics on free ports; the shortest
    prompts take the local-prefill route; both nodes keep a host KV tier."""
    clusters = _cluster(
        "--prefill", "1", "--decode", "1",
        "--http-port", str(free_ports(1)), "--metrics-port", str(free_ports(2)),
        "--local-prefill-max-tokens", str(HTTP_LOCAL_PREFILL_MAX_TOKENS),
        "--kv-offload-memory", "64MiB",
    )  # fmt: skip
    for cluster in clusters:
        cluster.http_url = http_url(cluster)
        cluster.metrics_urls = metrics_urls(cluster)
        yield cluster
