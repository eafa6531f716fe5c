"""`InFlightSteps`: the scheduler's launched steps whose results have not landed, oldest
first, and the block frees that wait for them.

A request that stops (or is aborted, preempted, released) while a launched step still writes
its KV keeps its blocks until that step's results are in: a block handed out at once could be
filled by another stream, a KV transfer, before the step's late write lands.
"""

from __future__ import annotations

from collections import deque

from engine.kv_cache_manager import KVCacheManager
from engine.request import Request
from engine.scheduler_output import SchedulerOutput


class InFlightSteps:
    def __init__(self, kv_cache_manager: KVCacheManager) -> None:
        self._kv_cache_manager = kv_cache_manager
        # launched steps not yet landed, oldest first, with their requests
        self._steps: deque[tuple[SchedulerOutput, frozenset[Request]]] = deque()
        self._free_after_step: list[Request] = []  # stopped while a launched step writes its KV

    def launched(self, scheduler_output: SchedulerOutput) -> None:
        requests = frozenset(c.request for c in scheduler_output.chunks)
        self._steps.append((scheduler_output, requests))

    def land(self, scheduler_output: SchedulerOutput) -> None:
        """The oldest launched step's results are in (it must be that step)."""
        if not self._steps or self._steps[0][0] is not scheduler_output:
            raise ValueError("update_from_output takes the oldest step passed to on_launched")
        self._steps.popleft()

    def free(self, request: Request) -> None:
        """Free `request`'s blocks now, or once no launched step writes them."""
        if any(request in requests for _, requests in self._steps):
            self._free_after_step.append(request)
        else:
            self._kv_cache_manager.free(request)

    def free_deferred(self) -> None:
        """After a step landed: the frees that waited for it (or wait on for a later one)."""
        if self._free_after_step:
            waiting, self._free_after_step = self._free_after_step, []
            for request in waiting:
                self.free(request)
