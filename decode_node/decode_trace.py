"""`DecodeTrace`: what a decode node records about each request, for tests and benchmarks.

    Decode(request) ──► DecodeTrace(request_id)      kept in DecodeTraces (the most recent)
    a layer's KV lands ──► layer_arrived_s[layer]    (TracingKVTransferManager)
    an output token is produced ──► token_times_s    (one entry per token, index = output index)

All times are `time.monotonic()` seconds.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from cache_transfer import KVLayout, KVTransferManager, KVTransport, protocol
from cache_transfer.receiver import KVCaches

MAX_TRACES = 1024  # requests whose DecodeTrace is kept (the most recent)


@dataclass
class DecodeTrace:
    request_id: str
    transfer_id: str = ""  # "" for LOCAL_PREFILL
    prefilled_locally: bool = False  # LOCAL_PREFILL, or the hand-off failed and it fell back
    layer_arrived_s: dict[int, float] = field(default_factory=dict)  # when each layer landed
    token_times_s: list[float] = field(default_factory=list)  # per output token, from index 0


class DecodeTraces(OrderedDict[str, DecodeTrace]):
    """`DecodeTrace`s by request id, bounded to the most recent `max_traces`; also by transfer
    id while a transfer is live."""

    def __init__(self, max_traces: int = MAX_TRACES) -> None:
        super().__init__()
        self.max_traces = max_traces
        self.by_transfer_id: dict[str, DecodeTrace] = {}

    def open(self, request_id: str) -> DecodeTrace:
        trace = self[request_id] = DecodeTrace(request_id)
        while len(self) > self.max_traces:
            self.popitem(last=False)
        return trace

    def on_layer_landed(self, transfer_id: str, layer_idx: int) -> None:
        trace = self.by_transfer_id.get(transfer_id)
        if trace is not None:
            trace.layer_arrived_s[layer_idx] = time.monotonic()


class TracingKVTransferManager(KVTransferManager):
    """A KVTransferManager that tells `traces` when each layer's payload lands."""

    def __init__(
        self, transport: KVTransport, layout: KVLayout, kv_caches: KVCaches, traces: DecodeTraces
    ) -> None:
        self._traces = traces
        super().__init__(transport, layout, kv_caches)

    def complete(self, peer_id: str, header: bytes, payload: torch.Tensor | None) -> None:
        super().complete(peer_id, header, payload)
        if payload is not None:  # a layer the receiver accepted in prepare() has landed
            msg = protocol.decode(header)
            self._traces.on_layer_landed(msg.transfer_id, msg.layer_manifest.layer_idx)
