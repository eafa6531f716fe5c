"""When `pd-bench serve` sends each request: seeded arrival processes.

```
rate inf            every request at t = 0 (bounded only by --max-concurrency)
rate r, burstiness 1  Poisson process: exponential gaps of mean 1/r
rate r, burstiness b  gamma gaps, shape b and mean 1/r: b < 1 burstier, b > 1 more regular
```
The first request goes at t = 0, request i after the sum of the first i gaps (as vLLM's
`bench serve`). Same seed, same times.
"""

from __future__ import annotations

import math
import random


def parse_rates(text: str) -> list[float]:
    """ "1,2,4" -> [1.0, 2.0, 4.0]; "inf" for all at once. Raises ValueError when bad."""
    rates = []
    for part in text.split(","):
        rate = float(part.strip())
        if not rate > 0:  # also refuses nan
            raise ValueError(f"request rate {part.strip()!r} must be > 0 (or inf)")
        rates.append(rate)
    if not rates:
        raise ValueError("no request rate given")
    return rates


def arrival_offsets_s(num: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send time of each of `num` requests, in seconds from the start."""
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(rate):
        return [0.0] * num
    rng = random.Random(seed)
    scale = 1.0 / (rate * burstiness)  # gamma mean = shape * scale = 1 / rate
    offsets, now = [], 0.0
    for _ in range(num):
        offsets.append(now)
        now += rng.gammavariate(burstiness, scale)
    return offsets


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"
