"""RouterStats: counters since the router started, for a future Stats/metrics endpoint."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class RouterStats:
    num_requests: int = 0  # Generate calls received
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

    @property
    def num_finished(self) -> int:
        return sum(self.finish_reasons.values())

    @property
    def num_errors(self) -> int:
        return sum(self.errors.values())

    @property
    def num_local_prefill_routes(self) -> int:
        return sum(self.local_prefill_routes.values())
