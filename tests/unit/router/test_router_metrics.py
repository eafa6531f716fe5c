"""RouterMetrics' shortcuts on the request path give the exposition the plain calls give."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram

from router.metrics import TOKEN_LATENCY_BUCKETS_S, RouterMetrics, observe_many


def _histogram() -> Histogram:
    return Histogram(
        "h_seconds", "h", buckets=TOKEN_LATENCY_BUCKETS_S, registry=CollectorRegistry()
    )


def _samples(histogram: Histogram) -> dict[tuple[str, str], float]:
    (metric,) = histogram.collect()
    return {
        (s.name, s.labels.get("le", "")): s.value for s in metric.samples if "created" not in s.name
    }


@pytest.mark.parametrize("value", [0.0, 0.001, 0.0049, 0.005, 0.3, 2.5, 7.0])
@pytest.mark.parametrize("count", [0, 1, 3, 15])
def test_observe_many_equals_count_observes(value: float, count: int) -> None:
    one_by_one, at_once = _histogram(), _histogram()
    for _ in range(count):
        one_by_one.observe(value)
    observe_many(at_once, value, count)

    expected, got = _samples(one_by_one), _samples(at_once)
    assert expected.keys() == got.keys()
    for key, number in expected.items():
        assert got[key] == pytest.approx(number), key


def test_child_is_labels_looked_up_once() -> None:
    metrics = RouterMetrics()
    for _ in range(3):
        metrics.child(metrics.node_requests, "10.0.0.1:1").inc()
    metrics.child(metrics.requests, "grpc", "OK", "length").inc()

    assert metrics.child(metrics.node_requests, "10.0.0.1:1") is metrics.node_requests.labels(
        "10.0.0.1:1"
    )
    text = metrics.render().decode()
    assert 'pdserve_node_requests_total{node="10.0.0.1:1"} 3.0' in text
    assert 'pdserve_requests_total{api="grpc",finish_reason="length",status="OK"} 1.0' in text
