"""RouterStats: what the router counts and times, kept as plain counters (a programmatic view)
and exported as Prometheus metrics (`RouterMetrics`), each event recorded once here.

```
dispatcher / request calls ──► routed, retry, prefill_failure
RequestHandler             ──► request_started, request_ended(RequestRecord)
                                 ──► counters, histograms, one access log line
```
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

from router.metrics import RouterMetrics
from router.request_record import RequestRecord

access_logger = logging.getLogger("router.access")


@dataclass
class RouterStats:
    num_requests: int = 0  # requests received (gRPC Generate calls, HTTP choices)
    num_cancelled: int = 0  # ended by the client (cancel or its deadline)
    num_prefill_failures: int = 0  # prefill calls that failed before the hand-off completed
    num_retries: int = 0  # node calls run again elsewhere (their node was unreachable)
    # Requests continued on another decode node after theirs died mid-stream (one per move).
    num_migrations: int = 0
    finish_reasons: Counter[str] = field(default_factory=Counter)  # "stop" | "length" | "abort"
    errors: Counter[str] = field(default_factory=Counter)  # by gRPC status name
    # Routes without a prefill node, by reason: "colocated" | "short_prompt" | "prefill_saturated"
    local_prefill_routes: Counter[str] = field(default_factory=Counter)
    requests_routed: Counter[str] = field(default_factory=Counter)  # node calls, by node address
    metrics: RouterMetrics = field(default_factory=RouterMetrics)

    @property
    def num_finished(self) -> int:
        return sum(self.finish_reasons.values())

    @property
    def num_errors(self) -> int:
        return sum(self.errors.values())

    @property
    def num_local_prefill_routes(self) -> int:
        return sum(self.local_prefill_routes.values())

    # ---- routing events ----------------------------------------------------------------------

    def routed(self, address: str) -> None:
        self.requests_routed[address] += 1
        self.metrics.child(self.metrics.node_requests, address).inc()

    def route_picked(self, local_reason: str | None) -> None:
        """A route: disaggregated (`local_reason` None) or local for `local_reason`."""
        m = self.metrics
        if local_reason is None:
            m.child(m.routes, "disaggregated", "").inc()
        else:
            self.local_prefill_routes[local_reason] += 1
            m.child(m.routes, "local", local_reason).inc()

    def retry(self) -> None:
        self.num_retries += 1
        self.metrics.retries.inc()

    def migration(self) -> None:
        """A request moved to another decode node mid-stream."""
        self.num_migrations += 1
        self.metrics.migration()

    def prefill_failure(self) -> None:
        self.num_prefill_failures += 1
        self.metrics.prefill_failures.inc()

    # ---- requests ----------------------------------------------------------------------------

    def request_started(self) -> None:
        self.num_requests += 1
        self.metrics.requests_running.inc()

    def request_ended(self, record: RequestRecord) -> None:
        """Counts and times one request however it ended, and logs its access line."""
        m = self.metrics
        m.requests_running.dec()
        if record.status == "OK":
            self.finish_reasons[record.finish_reason] += 1
        elif record.status == "CANCELLED":
            self.num_cancelled += 1
        else:
            self.errors[record.status] += 1
        m.child(m.requests, record.api, record.status, record.finish_reason or "").inc()
        m.generation_tokens.inc(record.completion_tokens)
        if (ttft_s := record.ttft_s) is not None:
            m.ttft.observe(ttft_s)
        if record.status == "OK":
            m.prompt_tokens.inc(record.prompt_tokens)
            m.cached_prompt_tokens.inc(record.cached_tokens)
            m.e2e.observe(record.total_s)
            if record.completion_tokens > 1:
                m.tpot.observe(record.tpot_s)
        access_logger.info(record.access_line(), extra={"request_id": record.request_id})
