"""What `pd-bench serve` measures: one `RequestRecord` per request, `summarize` per run.

Definitions (those of vLLM's `bench serve`, from the client's clock):
```
TTFT  first chunk carrying tokens  - send
E2E   end of the stream            - send
TPOT  (E2E - TTFT) / (output tokens - 1)       per request; requests of one token have none
ITL   gap between consecutive token-carrying chunks (one chunk may carry several tokens)
goodput  completed requests per second whose TTFT <= --slo-ttft-ms and TPOT <= --slo-tpot-ms
         (an unset SLO holds for every request; a request with no TPOT meets any TPOT SLO)
```
A request is completed when its stream ended with a finish reason; any other end (a gRPC
error, a stream cut without a finish) is failed, counted by status, and none of its timings
enters a latency figure. Percentiles interpolate linearly between order statistics (numpy's
default), so p50 is the median.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

OK = "OK"
NO_FINISH = "NO_FINISH"  # the stream ended without a finish reason
QUANTILES = {"median": 50.0, "p90": 90.0, "p99": 99.0}


@dataclass
class RequestRecord:
    """One request's timeline, in seconds from the start of its run (client clock)."""

    index: int
    prompt_len: int
    max_tokens: int
    send_s: float = math.nan
    end_s: float = math.nan
    chunk_times_s: list[float] = field(default_factory=list)  # token-carrying chunks only
    chunk_tokens: list[int] = field(default_factory=list)  # tokens in each of those chunks
    status: str = ""  # OK, NO_FINISH, or the gRPC status name
    error: str = ""
    finish_reason: str = ""

    @property
    def completed(self) -> bool:
        return self.status == OK

    @property
    def output_len(self) -> int:
        return sum(self.chunk_tokens)

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_times_s[0] - self.send_s if self.chunk_times_s else None

    @property
    def e2e_s(self) -> float:
        return self.end_s - self.send_s

    @property
    def tpot_s(self) -> float | None:
        ttft = self.ttft_s
        if ttft is None or self.output_len < 2:
            return None
        return (self.e2e_s - ttft) / (self.output_len - 1)

    @property
    def itls_s(self) -> list[float]:
        times = self.chunk_times_s
        return [later - earlier for earlier, later in zip(times, times[1:])]

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "output_len": self.output_len, "ttft_s": self.ttft_s,
                "tpot_s": self.tpot_s, "e2e_s": self.e2e_s}  # fmt: skip


@dataclass(frozen=True)
class Slo:
    """Latency targets; None: no target on that figure."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def met_by(self, record: RequestRecord) -> bool:
        if not record.completed:
            return False
        ttft, tpot = record.ttft_s, record.tpot_s
        if self.ttft_ms is not None and (ttft is None or ttft * 1e3 > self.ttft_ms):
            return False
        return self.tpot_ms is None or tpot is None or tpot * 1e3 <= self.tpot_ms


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation, as numpy.percentile."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    lower = math.floor(position)
    upper = min(lower + 1, len(ordered) - 1)
    return ordered[lower] + (ordered[upper] - ordered[lower]) * (position - lower)


def distribution_ms(values_s: list[float]) -> dict[str, float | None]:
    """mean, median, p90, p99 (and count) of `values_s`, in milliseconds; None when empty."""
    stats: dict[str, float | None] = {"count": len(values_s)}
    if not values_s:
        return {**stats, "mean": None, **dict.fromkeys(QUANTILES)}
    stats["mean"] = sum(values_s) / len(values_s) * 1e3
    for name, q in QUANTILES.items():
        stats[name] = percentile(values_s, q) * 1e3
    return stats


def summarize(records: list[RequestRecord], duration_s: float, slo: Slo) -> dict[str, Any]:
    """Every figure of one run over `duration_s` (first send to last end)."""
    done = [r for r in records if r.completed]
    failures = Counter(r.status for r in records if not r.completed)
    input_tokens = sum(r.prompt_len for r in done)
    output_tokens = sum(r.output_len for r in done)
    num_good = sum(slo.met_by(r) for r in done)
    per_s = 1.0 / duration_s if duration_s > 0 else math.nan
    return {
        "num_sent": len(records),
        "num_completed": len(done),
        "num_failed": len(records) - len(done),
        "failures_by_status": dict(sorted(failures.items())),
        "duration_s": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) * per_s,
        "output_throughput": output_tokens * per_s,
        "total_token_throughput": (input_tokens + output_tokens) * per_s,
        "num_good": num_good,
        "goodput": num_good * per_s,
        "slo_attainment": num_good / len(records) if records else math.nan,
        "ttft_ms": distribution_ms([r.ttft_s for r in done if r.ttft_s is not None]),
        "tpot_ms": distribution_ms([r.tpot_s for r in done if r.tpot_s is not None]),
        "itl_ms": distribution_ms([gap for r in done for gap in r.itls_s]),
        "e2e_ms": distribution_ms([r.e2e_s for r in done]),
    }
