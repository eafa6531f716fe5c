"""RouterStats: counters since the router started, for a future Stats/metrics endpoint."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class RouterStats:
    num_requests: int = 0  # Generate calls received
    num_cancelled: int = 0  # ended by the client (cancel or its deadline)
    num_prefill_failures: int = 0  # prefill calls that failed before the hand-off completed
    finish_reasons: Counter[str] = field(default_factory=Counter)  # "stop" | "length" | "abort"
    errors: Counter[str] = field(default_factory=Counter)  # by gRPC status name

    @property
    def num_finished(self) -> int:
        return sum(self.finish_reasons.values())

    @property
    def num_errors(self) -> int:
        return sum(self.errors.values())
