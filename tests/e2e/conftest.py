from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.e2e.cluster import Cluster
from tests.e2e.observe import http_url, metrics_urls
from tests.ports import free_port, free_ports, start_on_free_ports

MODEL = "smollm2-135m"
# The modules that start pd-serve clusters of the real model run one after another on one xdist
# worker (`make test`): a node of it holds ~1.2 GiB (tests/e2e/cluster.py), test_serving.py's
# three clusters ~9 GiB together, and two such modules at once would crowd a CI machine's memory.
REAL_MODEL_CLUSTERS = pytest.mark.xdist_group("real-model-clusters")
# Prompts of at most this many tokens are prefilled on the decode node (the HTTP cluster's
# local-prefill route); longer ones go through the prefill node.
HTTP_LOCAL_PREFILL_MAX_TOKENS = 2


def _cluster(*args: str, port_flags: Callable[[], list[str]] = list):
    """pd-serve with `args`, and `port_flags()`: fixed ports picked free (again, with a new
    pd-serve, when another process took one before pd-serve held it or a node bound it)."""
    flags = ["--model", MODEL, "--device", "cpu", "--dtype", "float32", *args]
    cluster = start_on_free_ports(lambda: Cluster([*flags, *port_flags()]).start())
    yield cluster
    leftover = cluster.stop()
    assert not leftover, f"processes left behind after Ctrl-C: {leftover}"


@pytest.fixture(scope="module")
def cluster_1p1d():
    yield from _cluster("--prefill", "1", "--decode", "1")


# One test uses each of these two: started for it and stopped after it (module-scoped, they
# lived until test_serving.py ended, with cluster_1p1d: 7 nodes, ~8.4 GiB, at once).
@pytest.fixture
def cluster_colocated():
    yield from _cluster("--prefill", "0", "--decode", "1")


@pytest.fixture
def cluster_2p2d():
    yield from _cluster("--prefill", "2", "--decode", "2")


@pytest.fixture(scope="module")
def cluster_http():
    """1P1D with the OpenAI HTTP API and every node's /metrics on free ports; the shortest
    prompts take the local-prefill route; both nodes keep a host KV tier."""
    clusters = _cluster(
        "--prefill", "1", "--decode", "1",
        "--local-prefill-max-tokens", str(HTTP_LOCAL_PREFILL_MAX_TOKENS),
        "--kv-offload-memory", "64MiB",
        port_flags=lambda: ["--http-port", str(free_port()), "--metrics-port", str(free_ports(2))],
    )  # fmt: skip
    for cluster in clusters:
        cluster.http_url = http_url(cluster)
        cluster.metrics_urls = metrics_urls(cluster)
        yield cluster
