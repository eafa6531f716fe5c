"""RouterMetrics: the router's Prometheus metrics, in its own `CollectorRegistry`.

Served on the router's HTTP port at `/metrics` (`router.http`). One registry per router (not
prometheus_client's global one), so several routers in one process (tests) do not collide.
Names follow Prometheus conventions: `pdserve_` prefix, base units, counters end in `_total`.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

M = TypeVar("M", Counter, Histogram)

# Seconds: from a few ms (small models, local) up to minutes (long prompts, long outputs).
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                     1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
TOKEN_LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1,
                           0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)  # fmt: skip
E2E_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)


class RouterMetrics:
    """Every metric the router exports; `render()` is the /metrics body."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "pdserve_requests",
            "requests ended, by API, final status (gRPC status name; OK when served) and "
            "finish reason (stop | length | abort; empty when failed)",
            ["api", "status", "finish_reason"], registry=r,
        )  # fmt: skip
        self.requests_running = Gauge(
            "pdserve_requests_running", "requests the router is serving now", registry=r
        )
        self.ttft = Histogram(
            "pdserve_time_to_first_token_seconds",
            "from a request's arrival to its first output token leaving the router",
            buckets=LATENCY_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.tpot = Histogram(
            "pdserve_time_per_output_token_seconds",
            "per request: (end - first token) / (output tokens - 1), requests with 2+ tokens",
            buckets=TOKEN_LATENCY_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.itl = Histogram(
            "pdserve_inter_token_latency_seconds",
            "between successive output tokens as the router sends them (a chunk of k tokens "
            "counts k samples of gap / k)",
            buckets=TOKEN_LATENCY_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.e2e = Histogram(
            "pdserve_e2e_request_latency_seconds",
            "from a request's arrival to its last output token (served requests)",
            buckets=E2E_BUCKETS_S, registry=r,
        )  # fmt: skip
        self._add_counters(r)
        self._migrations: Counter | None = None  # created by the first migration()
        self._children: dict[tuple[object, ...], Any] = {}  # labels() results

    def child(self, metric: M, *labels: str) -> M:
        """`metric.labels(*labels)`, looked up once (labels() validates and locks each call:
        the request path calls this several times a request)."""
        key = (id(metric), *labels)
        child: M | None = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def _add_counters(self, r: CollectorRegistry) -> None:
        self.prompt_tokens = Counter(
            "pdserve_prompt_tokens", "prompt tokens of served requests", registry=r
        )
        self.generation_tokens = Counter(
            "pdserve_generation_tokens", "output tokens sent to clients", registry=r
        )
        self.cached_prompt_tokens = Counter(
            "pdserve_prefix_cache_hit_tokens",
            "prompt tokens of served requests that a node found in its prefix cache",
            registry=r,
        )
        self.routes = Counter(
            "pdserve_routes",
            "routes picked: disaggregated (prefill + decode node) or local (the decode node "
            "prefills: colocated | short_prompt | prefill_saturated)",
            ["kind", "reason"], registry=r,
        )  # fmt: skip
        self.node_requests = Counter(
            "pdserve_node_requests",
            "node calls started, by node address (retries included)",
            ["node"], registry=r,
        )  # fmt: skip
        self.retries = Counter(
            "pdserve_retries", "node calls run again on another node (it was unreachable)",
            registry=r,
        )  # fmt: skip
        self.prefill_failures = Counter(
            "pdserve_prefill_failures",
            "prefill calls that failed before the hand-off (the decode node fell back to a "
            "local prefill)",
            registry=r,
        )

    def migration(self) -> None:
        """Hook for request migration (a running request moved to another decode node):
        counts `pdserve_request_migrations_total`, which appears once something migrates."""
        if self._migrations is None:
            self._migrations = Counter(
                "pdserve_request_migrations",
                "running requests moved to another decode node",
                registry=self.registry,
            )
        self._migrations.inc()

    def observe_itl(self, gap_s: float, num_tokens: int) -> None:
        """`num_tokens` inter-token latency samples of `gap_s` (a chunk of k tokens)."""
        observe_many(self.itl, gap_s, num_tokens)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


def observe_many(histogram: Histogram, value: float, count: int) -> None:
    """`count` observations of `value` for the cost of one (prometheus_client's Histogram has no
    weighted observe): its sum and the bucket `value` falls in move by `count`. Falls back to
    `count` observes where the histogram's internals are not the ones this was written for."""
    buckets = getattr(histogram, "_buckets", None)
    bounds = getattr(histogram, "_upper_bounds", None)
    total = getattr(histogram, "_sum", None)
    if count <= 1 or buckets is None or bounds is None or total is None:
        for _ in range(count):
            histogram.observe(value)
        return
    total.inc(value * count)
    buckets[bisect_left(bounds, value)].inc(count)  # the first bound >= value, as observe()
