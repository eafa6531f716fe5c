"""Disaggregated serving end to end with the KV moved by each transport named explicitly:
a 1P1D pd-serve cluster gives, for 8 concurrent greedy prompts, exactly the tokens of colocated
serving and of the offline engine, every request's KV crossed the named transport, and no
block is left held. (`--kv-transport auto`, test_serving.py's default, resolves to ucx where
`ucxx` imports.)"""

from __future__ import annotations

import grpc
import pytest

from cache_transfer.transports import ucx_available
from pdserve.v1 import node_pb2, node_pb2_grpc
from tests.e2e.cluster import Cluster
from tests.e2e.conftest import MODEL, REAL_MODEL_CLUSTERS
from tests.e2e.test_serving import MAX_TOKENS, PROMPTS, greedy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), REAL_MODEL_CLUSTERS]

TRANSPORTS = [
    pytest.param(
        "ucx", marks=pytest.mark.skipif(not ucx_available(), reason="ucxx does not import here")
    ),
    "tcp",
]


@pytest.fixture(scope="module", params=TRANSPORTS)
def cluster_1p1d_over(request: pytest.FixtureRequest):
    args = ["--model", MODEL, "--device", "cpu", "--dtype", "float32"]
    args += ["--prefill", "1", "--decode", "1", "--kv-transport", request.param]
    cluster = Cluster(args).start()
    yield request.param, cluster
    leftover = cluster.stop()
    assert not leftover, f"processes left behind after Ctrl-C: {leftover}"


@pytest.fixture(scope="module")
def offline_tokens() -> tuple[list[list[int]], object]:
    from engine import LLM, SamplingParams

    llm = LLM(MODEL, device="cpu", dtype="float32")
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    return [o.token_ids for o in outs], llm.tokenizer


def _kv_transport(cluster: Cluster, node: str) -> str:
    with grpc.insecure_channel(cluster.nodes[node]) as channel:
        info = node_pb2_grpc.NodeStub(channel).GetNodeInfo(
            node_pb2.GetNodeInfoRequest(), timeout=10
        )
    return info.kv_transport


def test_1p1d_over_each_transport_equals_colocated_and_offline(
    cluster_1p1d_over, cluster_colocated, offline_tokens
):
    transport, cluster = cluster_1p1d_over
    expected, tokenizer = offline_tokens
    assert _kv_transport(cluster, "prefill-0") == _kv_transport(cluster, "decode-0") == transport

    disaggregated = greedy(cluster.router)
    colocated = greedy(cluster_colocated.router)

    assert [r.token_ids for r in disaggregated] == expected == [r.token_ids for r in colocated]
    assert [r.text for r in disaggregated] == [tokenizer.decode(ids) for ids in expected]
    decode_stats = cluster.node_stats("decode-0")
    assert cluster.node_stats("prefill-0").num_finished_requests >= len(PROMPTS)
    assert decode_stats.num_local_prefills == 0 and decode_stats.num_failed_transfers == 0
    stats = cluster.wait_all_blocks_free(timeout_s=5)
    assert all(s.num_free_kv_blocks == s.num_kv_blocks for s in stats.values()), stats
