"""`PrefillHandOffs`: how the prefill node sends a request's KV, whatever the two nodes'
tensor-parallel sizes.

```
sender(request_id, ticket, timeout_s, ceiling_s) -> KVSink
    this node TP 1 and the ticket's decode node TP 1: one KVSender (today's hand-off: writes in
    place on one GPU, coalesced sends)
    else: rank 0's FanOutSender (the routes leaving rank 0: TicketError when the ticket does
    not verify or the sizes cannot be matched), and, for each other rank with routes, its
    share (RemotePart) joined and the rank told (SendKV: its own routes take its layers)
close(request_id)   the call ended: every other rank drops the request (CloseRequest)
```
"""

from __future__ import annotations

import grpc

from cache_transfer import KVTransferManager
from cache_transfer.tp import FanOutSender, TicketRefused
from node_common.node_base import NodeBase
from node_common.tp.rank_messages import CloseRequest, SendKV
from node_common.tp.rank_worker import rank_heads
from pdserve.v1 import node_pb2
from prefill_node.outgoing import KVSink


class HandOffRefused(Exception):
    """The ticket cannot be used (it does not verify, or the sizes cannot be matched)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class PrefillHandOffs:
    def __init__(self, node: NodeBase, manager: KVTransferManager) -> None:
        self._node = node
        self._manager = manager

    def sender(
        self, request_id: str, ticket: node_pb2.TransferTicket, timeout_s: float, ceiling_s: float
    ) -> KVSink:
        """What sends `request_id`'s KV on `ticket`: no progress for `timeout_s` or
        `ceiling_s` from now fails it (ValueError: the transfer id is in use here;
        HandOffRefused: see the module doc)."""
        tp_ranks = self._node.tp_ranks
        if tp_ranks is None and ticket.tp_size <= 1:
            return self._manager.create_sender(ticket, timeout_s, ceiling_s, request_id)
        ranks = tp_ranks.prefill_ranks() if tp_ranks else [rank_heads(self._node.core)]
        try:
            fan_out = FanOutSender.create(
                self._manager, ticket, self._node.layout, ranks[0], ranks, timeout_s, ceiling_s,
                request_id,
            )  # fmt: skip
        except TicketRefused as error:
            raise HandOffRefused(grpc.StatusCode.FAILED_PRECONDITION, str(error)) from None
        if tp_ranks is not None:
            data = ticket.SerializeToString()
            for rank in sorted({route.src_rank for route in fan_out.plan} - {0}):
                fan_out.add_remote(tp_ranks.remote_part(ticket.transfer_id, rank))
                tp_ranks.note(rank, SendKV(request_id, data, timeout_s, ceiling_s))
        fan_out.seal()
        return fan_out

    def close(self, request_id: str, reason: str) -> None:
        if self._node.tp_ranks is not None:
            self._node.tp_ranks.note_all(CloseRequest(request_id, reason))
