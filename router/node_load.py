"""NodeLoad: what the router knows of one node's load, and the estimates policies compare.

```
registry heartbeat ──► report (NodeLoadReport) + capacity         stale by up to a heartbeat
Dispatcher         ──► track(num_tokens) ... InflightWork.done()  the router's own, at once
estimate           ──► max(report's figure - this router's work finished since the report,
                           in-flight figure)
```

The larger of the two, not the sum: the report already counts the router's requests that
reached the node; the in-flight count sees a burst before the next report does. Work this
router finished after the report was written is taken off it, so a stale report of a node
that has since gone idle does not push traffic away from it.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from pdserve.registry import NodeLoadReport, NodeRecord

_MAX_FINISHED = 4096  # finished requests remembered against a report that is not refreshed


class NodeLoad:
    """One node's load: its last report (none for a static node) and the work in flight."""

    def __init__(self) -> None:
        self.report: NodeLoadReport | None = None
        self.report_time_s = 0.0  # unix time the node wrote the report
        self.num_kv_blocks = 0  # capacity, from the record
        self.block_size = 0
        self.num_inflight_requests = 0
        self.num_inflight_tokens = 0
        self._finished: deque[tuple[float, int]] = deque()  # (unix time, tokens) since report
        self._num_finished_tokens = 0  # their sum

    def update(self, record: NodeRecord) -> None:
        """Takes the load report and capacity of a registry record."""
        self.report = record.load
        self.report_time_s = record.updated_at_s
        self.num_kv_blocks = record.num_kv_blocks
        self.block_size = record.block_size
        while self._finished and self._finished[0][0] <= self.report_time_s:
            self._num_finished_tokens -= self._finished.popleft()[1]

    def track(self, num_tokens: int) -> InflightWork:
        """Counts one request of `num_tokens` as in flight until `done()`."""
        self.num_inflight_requests += 1
        self.num_inflight_tokens += num_tokens
        return InflightWork(self, num_tokens)

    def finish(self, num_tokens: int) -> None:
        """A tracked request of `num_tokens` ended (called by `InflightWork.done`)."""
        self.num_inflight_requests -= 1
        self.num_inflight_tokens -= num_tokens
        if self.report is not None:
            self._finished.append((time.time(), num_tokens))
            self._num_finished_tokens += num_tokens
            if len(self._finished) > _MAX_FINISHED:
                self._num_finished_tokens -= self._finished.popleft()[1]

    @property
    def idle(self) -> bool:
        return self.num_inflight_requests == 0

    @property
    def queued_prefill_tokens(self) -> int:
        """Prompt tokens waiting to be prefilled (a prefill node's load)."""
        reported = self.report.num_queued_prefill_tokens if self.report else 0
        return self._estimate(reported)

    @property
    def load_tokens(self) -> int:
        """Tokens a decode node holds or will hold: KV in use plus prompts queued to prefill,
        or the in-flight requests' prompt + max_tokens."""
        reported = 0
        if self.report is not None:
            used_blocks = max(self.num_kv_blocks - self.report.num_free_kv_blocks, 0)
            reported = used_blocks * self.block_size + self.report.num_queued_prefill_tokens
        return self._estimate(reported)

    def fits(self, num_blocks: int) -> bool:
        """Whether the last report had `num_blocks` free KV blocks (True with no report)."""
        return self.report is None or self.report.num_free_kv_blocks >= num_blocks

    @property
    def num_free_kv_blocks(self) -> int | None:
        return self.report.num_free_kv_blocks if self.report else None

    def _estimate(self, reported: int) -> int:
        return max(reported - self._num_finished_tokens, self.num_inflight_tokens, 0)


@dataclass
class InflightWork:
    """One request's share of a NodeLoad; `done()` (idempotent) gives it back."""

    load: NodeLoad
    num_tokens: int
    finished: bool = False

    def done(self) -> None:
        if not self.finished:
            self.finished = True
            self.load.finish(self.num_tokens)
