"""What one route of a tensor-parallel hand-off is to the sessions and the manager (the
routes themselves are planned and driven by cache_transfer/tp/).

A route carries the kv heads `[start, end)` of the model from one prefill rank to one decode
rank; its session is named `<transfer_id>:<route>` (tp/route_ids.py) and runs as any other
over the head slice's layout, the receiver writing into views of its pool over those heads.
"""

from __future__ import annotations

from dataclasses import dataclass

from cache_transfer.layout import HeadSlice, KVCaches, KVLayout
from pdserve.v1 import node_pb2


@dataclass(frozen=True)
class ReceiverRoute:
    """A receiver that is one route of a tensor-parallel hand-off (cache_transfer/tp/)."""

    ticket: node_pb2.TransferTicket  # the route's, derived from the decode node's ticket
    heads: HeadSlice  # what the sender's handshake must say it carries
    first_token: bool  # the first token comes on this route (prefill rank 0 -> decode rank 0)


# A TP hand-off's route sessions are named "<transfer_id><ROUTE_SEPARATOR><route>"
ROUTE_SEPARATOR = ":"


@dataclass(frozen=True)
class RouteSlice:
    """One route of a tensor-parallel hand-off, as a session sees it (cache_transfer/tp/):
    the layout of its head slice and, on the receiver, the caches' views over those heads."""

    layout: KVLayout
    heads: HeadSlice
    first_token: bool  # the route from prefill rank 0 to decode rank 0 carries it
    kv_caches: KVCaches = ()  # receiver: per layer (k, v) views over the route's heads
    ticket: node_pb2.TransferTicket | None = None  # receiver: the route's ticket

    @property
    def receiver(self) -> ReceiverRoute:
        assert self.ticket is not None, "a receiving route needs its ticket"
        return ReceiverRoute(self.ticket, self.heads, self.first_token)
