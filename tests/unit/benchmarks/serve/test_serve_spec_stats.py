"""pd-bench serve's speculative-decoding summary: the run's share of the node counters."""

from __future__ import annotations

from types import SimpleNamespace

from benchmarks.serve import spec_stats
from pdserve.v1 import node_pb2


def test_the_summary_is_the_runs_delta() -> None:
    got = spec_stats.summary((2, 8, 4), (12, 48, 24))  # 10 verifies, 40 drafts, 20 accepted
    assert got == {
        "spec_acceptance_rate": 0.5,
        "spec_mean_accepted_tokens": 2.0,
        "spec_draft_tokens": 40,
    }
    runs = [
        {"config": "1P1D", "request_rate": 2.0, "summary": got},
        {"config": "1P1D", "request_rate": 4.0, "summary": {}},
    ]
    assert spec_stats.text(runs) == (
        "1P1D @ 2.0 req/s: speculative decoding accepted 50.0% of 40 draft tokens, 2.00 per verify"
    )


def test_nothing_without_a_cluster_or_a_verify() -> None:
    assert spec_stats.read_counters(None) is None
    assert spec_stats.summary(None, None) == {}
    assert spec_stats.summary((3, 9, 1), (3, 9, 1)) == {}  # speculation off, or no draft
    assert spec_stats.text([{"config": "c", "request_rate": 1.0, "summary": {}}]) == ""


def test_counters_are_summed_over_the_nodes() -> None:
    stats = {
        "prefill-0": node_pb2.NodeStats(),
        "decode-0": node_pb2.NodeStats(
            num_spec_verifies=3, num_spec_draft_tokens=12, num_spec_accepted_tokens=5
        ),
        "decode-1": node_pb2.NodeStats(
            num_spec_verifies=1, num_spec_draft_tokens=4, num_spec_accepted_tokens=4
        ),
    }
    cluster = SimpleNamespace(nodes=dict.fromkeys(stats, ""), node_stats=stats.__getitem__)
    assert spec_stats.read_counters(cluster) == (4, 16, 9)  # type: ignore[arg-type]
