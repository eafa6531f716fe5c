"""`TransferTrace`: when each layer of one KV hand-off was computed and sent, and the
hand-off's milestones (the prefill node's side; `GetStats.last_transfer` reports the newest)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class TransferTrace:
    """When each layer of one transfer was computed (the engine's hook fired) and when its send
    completed, in `time.monotonic()` seconds; None where that never happened."""

    transfer_id: str
    request_id: str
    layer_computed_s: list[float | None]
    layer_sent_s: list[float | None]
    # CUDA: layer_computed_s is when the sender saw the layer's KV-written event complete (the
    # hook runs ahead of the GPU; one GPU: the layers held back, when the one they waited for
    # was seen); CPU: when the hook ran
    # milestones by name: "rpc", "ticket" (its ticket is in: inline, or AttachTicket),
    # "computing", "first_token", "layers_handed", "result"
    marks_s: dict[str, float] = field(default_factory=dict)

    def mark(self, name: str) -> None:
        self.marks_s[name] = time.monotonic()
