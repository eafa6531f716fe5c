"""One Decode call's state, as Abort and CancelTransfer find it, the node's counters, and how a
call is refused for lack of KV room (RESOURCE_EXHAUSTED with a retry hint)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NoReturn

import grpc

from cache_transfer.tp import TPReceiver
from decode_node.decode_trace import DecodeTrace
from decode_node.kv_admission import AdmissionRefused
from decode_node.transfer_caps import PendingHold, TransferCapExceeded
from node_common.role_servicer import NodeCounters, abort_call


@dataclass
class DecodeCounters(NodeCounters):
    """Since the node started (num_finished_requests: streams that ended with a finish_reason;
    num_queued_prefill_tokens: prompt tokens of local prefills with no token yet)."""

    num_local_prefills: int = 0  # LOCAL_PREFILL requests and fallbacks
    num_fallbacks: int = 0  # DISAGGREGATED requests whose hand-off failed


@dataclass
class DecodeJob:
    """One Decode call, as Abort and CancelTransfer find it."""

    request_id: str
    trace: DecodeTrace
    receiver: TPReceiver | None = None  # DISAGGREGATED, while the KV is awaited
    block_ids: list[int] = field(default_factory=list)  # reserved: held prefix, then received
    hold: PendingHold | None = None  # its blocks, counted against its caller meanwhile
    aborted: bool = False
    finished: bool = False  # the stream delivered its finish_reason


class Refused(Exception):
    """Carries an AdmissionRefused out of a token generator to the Decode handler."""

    def __init__(self, error: AdmissionRefused) -> None:
        super().__init__(str(error))
        self.error = error


async def refuse(
    context: grpc.aio.ServicerContext, error: AdmissionRefused | TransferCapExceeded
) -> NoReturn:
    """RESOURCE_EXHAUSTED with a retry hint (in the message and as trailing metadata)."""
    context.set_trailing_metadata((("pdserve-retry-after-s", f"{error.retry_after_s:g}"),))
    await abort_call(context, grpc.StatusCode.RESOURCE_EXHAUSTED, f"decode node: {error}")
