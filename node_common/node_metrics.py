"""NodeMetrics: one node's Prometheus metrics, in its own `CollectorRegistry`, served on
`--metrics-port` (0: off) at `/metrics` by prometheus_client's HTTP server (a thread).

```
scrape ──► NodeStatsCollector: the node's NodeStats read on its event loop (gauges: running,
           waiting, KV blocks, host-tier blocks, pending transfers; counters: finished,
           prefix-cache hits (all tiers, host tier), host-tier offload and promotion bytes,
           local prefills, prefilled tokens, fallbacks, speculative decoding's verifies, drafts,
           accepted and emitted tokens; gauges since the start: its acceptance ratio and mean
           accepted tokens per verify)
transfer session finished ──► transfer_finished: bytes moved and skipped (the decode node held
                              them: a suffix-only hand-off), per successful hand-off both as a
                              histogram, duration histogram, result ok | failed (by direction:
                              sent on the prefill node, received on the decode node; every
                              series of the node's direction exists from the start)
```
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pdserve.net import host_port
from pdserve.v1 import node_pb2

logger = logging.getLogger(__name__)

# bytes of one hand-off: 64 KiB .. 64 GiB, x4 per bucket
HANDOFF_BYTES_BUCKETS = tuple(float(1 << shift) for shift in range(16, 37, 2))
TRANSFER_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                      10.0, 30.0)  # fmt: skip
_SCRAPE_TIMEOUT_S = 5.0

# NodeStats field -> (metric name, help); gauges are load right now, counters since the start.
_GAUGES = {
    "num_running_requests": ("pdserve_node_requests_running", "requests in the engine's batch"),
    "num_waiting_requests": ("pdserve_node_requests_waiting", "requests queued in the engine"),
    "num_kv_blocks": ("pdserve_node_kv_blocks", "KV cache blocks in the pool"),
    "num_free_kv_blocks": ("pdserve_node_kv_blocks_free", "KV cache blocks free"),
    "num_pending_transfers": ("pdserve_node_kv_transfers_pending", "KV hand-offs in flight"),
    "num_queued_prefill_tokens": (
        "pdserve_node_queued_prefill_tokens", "prompt tokens accepted and not prefilled yet"),
    "num_host_kv_blocks": ("pdserve_node_host_kv_blocks", "blocks of the host KV tier"),
    "num_free_host_kv_blocks": (
        "pdserve_node_host_kv_blocks_free", "host KV tier blocks holding no KV"),
}  # fmt: skip
_COUNTERS = {
    "num_finished_requests": ("pdserve_node_requests_finished", "requests whose output went out"),
    "num_prefix_cache_hit_tokens": (
        "pdserve_node_prefix_cache_hit_tokens", "prompt tokens found in the prefix cache"),
    "num_host_prefix_cache_hit_tokens": (
        "pdserve_node_prefix_cache_host_hit_tokens",
        "prompt tokens found in the host KV tier (promoted; also in the prefix cache hits)"),
    "num_kv_offload_bytes": (
        "pdserve_node_kv_offload_bytes", "KV bytes copied from the device pool to the host tier"),
    "num_kv_promotion_bytes": (
        "pdserve_node_kv_promotion_bytes", "KV bytes copied from the host tier back to the device"),
    "num_local_prefills": ("pdserve_node_local_prefills", "prompts prefilled on this decode node"),
    "num_prefilled_tokens": (
        "pdserve_node_prefilled_tokens",
        "prompt tokens this node's engine computed (prefix-cache hits not; recomputes again)"),
    "num_in_place_transfers": (
        "pdserve_node_kv_transfers_in_place",
        "successful KV hand-offs the prefill node wrote into the decode node's blocks itself"),
    "num_spec_verifies": (
        "pdserve_node_spec_decode_verifies",
        "speculative verify chunks (one request's drafts verified in one step)"),
    "num_spec_draft_tokens": (
        "pdserve_node_spec_decode_draft_tokens", "speculative draft tokens verified"),
    "num_spec_accepted_tokens": (
        "pdserve_node_spec_decode_accepted_tokens", "speculative draft tokens accepted"),
    "num_spec_emitted_tokens": (
        "pdserve_node_spec_decode_emitted_tokens",
        "tokens speculative verify chunks emitted (accepted drafts + the model's own)"),
    "num_fallbacks": (
        "pdserve_node_kv_transfer_fallbacks",
        "disaggregated requests whose hand-off failed and that were prefilled here instead"),
}  # fmt: skip

StatsReader = Callable[[], dict[str, int] | None]


class NodeStatsCollector:
    """Reads the node's stats at each scrape (None: skipped, e.g. the node is stopping)."""

    def __init__(self, read: StatsReader) -> None:
        self._read = read

    def describe(self) -> list[Metric]:
        return []  # no collect() at registration time

    def collect(self) -> Iterator[Metric]:
        stats = self._read()
        if stats is None:
            return
        for field, (name, doc) in _GAUGES.items():
            if field in stats:
                yield GaugeMetricFamily(name, doc, value=stats[field])
        total = stats.get("num_kv_blocks", 0)
        if total:
            used = (total - stats.get("num_free_kv_blocks", 0)) / total
            yield GaugeMetricFamily(
                "pdserve_node_kv_cache_usage_ratio", "used KV blocks / all KV blocks", value=used
            )
        for field, (name, doc) in _COUNTERS.items():
            if field in stats:
                yield CounterMetricFamily(name, doc, value=stats[field])
        yield from _spec_ratios(stats)


def _spec_ratios(stats: dict[str, int]) -> Iterator[Metric]:
    """Speculative decoding since the start (none before its first verify): acceptance rate
    and mean accepted length (rates over a window: the counters' rate() ratios)."""
    verifies, drafts = stats.get("num_spec_verifies", 0), stats.get("num_spec_draft_tokens", 0)
    if not (verifies and drafts):
        return
    accepted = stats.get("num_spec_accepted_tokens", 0)
    yield GaugeMetricFamily(
        "pdserve_node_spec_decode_acceptance_ratio",
        "draft tokens accepted / verified, since the start", value=accepted / drafts,
    )  # fmt: skip
    yield GaugeMetricFamily(
        "pdserve_node_spec_decode_mean_accepted_tokens",
        "draft tokens accepted per verify chunk (per request and step), since the start",
        value=accepted / verifies,
    )  # fmt: skip


class NodeMetrics:
    def __init__(self, role: str, model: str, read_stats: StatsReader) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        info = Gauge(
            "pdserve_node_info", "this node: role and model", ["role", "model"], registry=r
        )
        info.labels(role, model).set(1)
        self.transfer_bytes = Counter(
            "pdserve_node_kv_transfer_bytes", "KV cache bytes moved, by direction",
            ["direction"], registry=r,
        )  # fmt: skip
        self.skipped_bytes = Counter(
            "pdserve_node_kv_transfer_skipped_bytes",
            "KV bytes of hand-offs' prompts not moved: the decode node held them already",
            ["direction"], registry=r,
        )  # fmt: skip
        self.handoff_bytes = Histogram(
            "pdserve_node_kv_handoff_bytes",
            "per successful KV hand-off: bytes moved (part=transferred) and not moved because "
            "the decode node held them (part=skipped)",
            ["direction", "part"], buckets=HANDOFF_BYTES_BUCKETS, registry=r,
        )  # fmt: skip
        self.transfers = Counter(
            "pdserve_node_kv_transfers", "KV hand-offs ended, by direction and result",
            ["direction", "result"], registry=r,
        )  # fmt: skip
        self.transfer_duration = Histogram(
            "pdserve_node_kv_transfer_duration_seconds",
            "a KV hand-off from its session's start to its end (successful ones)",
            ["direction"], buckets=TRANSFER_BUCKETS_S, registry=r,
        )  # fmt: skip
        # A node moves KV one way: its series exist (at 0) from the start, failures included.
        direction = "sent" if role == "prefill" else "received"
        self.transfer_bytes.labels(direction)
        self.skipped_bytes.labels(direction)
        for part in ("transferred", "skipped"):
            self.handoff_bytes.labels(direction, part)
        for result in ("ok", "failed"):
            self.transfers.labels(direction, result)
        r.register(NodeStatsCollector(read_stats))
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self.url: str | None = None

    def transfer_finished(self, session: Any) -> None:
        """`TransferSession.add_finish_callback` target (a KVSender or a KVReceiver)."""
        sent = hasattr(session, "num_bytes_sent")
        direction = "sent" if sent else "received"
        num_bytes = session.num_bytes_sent if sent else session.num_bytes_received
        ok = session.state.name == "SUCCESS"
        num_skipped = session.num_bytes_skipped
        self.transfer_bytes.labels(direction).inc(num_bytes)
        self.skipped_bytes.labels(direction).inc(num_skipped)
        self.transfers.labels(direction, "ok" if ok else "failed").inc()
        if ok:
            self.transfer_duration.labels(direction).observe(session.elapsed_s)
            self.handoff_bytes.labels(direction, "transferred").observe(num_bytes)
            self.handoff_bytes.labels(direction, "skipped").observe(num_skipped)

    def serve(self, host: str, port: int) -> None:
        """Serves /metrics on HOST:PORT in a thread. Raises OSError when it cannot bind."""
        self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        self.url = f"http://{host_port(host, self._server.server_port)}/metrics"

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def loop_stats_reader(
    loop: asyncio.AbstractEventLoop, stats: Callable[[], Coroutine[Any, Any, dict[str, int]]]
) -> StatsReader:
    """A StatsReader for a scrape thread: runs the coroutine `stats()` (-> dict) on `loop`,
    for at most _SCRAPE_TIMEOUT_S (then cancelled: a scrape answers without the node's stats
    rather than wait for a long engine step)."""

    def read() -> dict[str, int] | None:
        if not loop.is_running() or _in_loop(loop):
            return None
        future = asyncio.run_coroutine_threadsafe(stats(), loop)
        try:
            return future.result(_SCRAPE_TIMEOUT_S)
        except Exception as error:  # a scrape must not fail the node
            future.cancel()
            logger.warning("metrics: reading the node's stats failed: %r", error)
            return None

    return read


def _in_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


def stats_fields(stats: node_pb2.NodeStats) -> dict[str, int]:
    """Every field, zeros included."""
    return {field.name: getattr(stats, field.name) for field in stats.DESCRIPTOR.fields}
