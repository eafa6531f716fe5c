"""`DecodeTrace`: what a decode node records about each request, for tests and benchmarks.

    Decode(request) ──► DecodeTrace(request_id)      kept in DecodeTraces (the most recent)
    a layer's KV lands ──► layer_arrived_s[layer]    (the receiver's layer callback)
    an output token is produced ──► token_times_s    (one entry per token, index = output index)
    milestones ──► marks_s["rpc" | "ticket" | "kv_done" | "decoding"]   (mark())

All times are `time.monotonic()` seconds.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

MAX_TRACES = 1024  # requests whose DecodeTrace is kept (the most recent)


@dataclass
class DecodeTrace:
    request_id: str
    transfer_id: str = ""  # "" for LOCAL_PREFILL
    prefilled_locally: bool = False  # LOCAL_PREFILL, or the hand-off failed and it fell back
    layer_arrived_s: dict[int, float] = field(default_factory=dict)  # when each layer landed
    token_times_s: list[float] = field(default_factory=list)  # per output token, from index 0
    marks_s: dict[str, float] = field(default_factory=dict)  # milestones by name

    def mark(self, name: str) -> None:
        self.marks_s[name] = time.monotonic()

    def on_layer_landed(self, layer_idx: int, token_end: int) -> None:
        """`KVReceiver.add_layer_callback` target: the layer's KV is in the cache."""
        self.layer_arrived_s[layer_idx] = time.monotonic()


class DecodeTraces(OrderedDict[str, DecodeTrace]):
    """`DecodeTrace`s by request id, bounded to the most recent `max_traces`."""

    def __init__(self, max_traces: int = MAX_TRACES) -> None:
        super().__init__()
        self.max_traces = max_traces

    def open(self, request_id: str) -> DecodeTrace:
        trace = self[request_id] = DecodeTrace(request_id)
        trace.mark("rpc")
        while len(self) > self.max_traces:
            self.popitem(last=False)
        return trace
