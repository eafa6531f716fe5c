"""`DecodeServer`: one decode node (see README.md for a request's lifecycle).

DecodeServer(core, config)   a NodeBase (node_common) whose KV transport receives into the
                             engine's KV cache, serving DecodeNode (Decode, CancelTransfer)
                             through a DecodeServicer; start/stop as every node
"""

from __future__ import annotations

import grpc
import torch

from decode_node.decode_servicer import DecodeServicer
from decode_node.decode_trace import DecodeTraces
from decode_node.tp_rank import DecodeRankAgent
from engine.engine_core import EngineStats
from node_common.node_base import NodeBase
from pdserve.v1 import node_pb2, node_pb2_grpc


class DecodeServer(NodeBase):
    """A decode node: construct inside the event loop it will serve on."""

    role = node_pb2.NODE_ROLE_DECODE
    role_service = node_pb2.DESCRIPTOR.services_by_name["DecodeNode"].full_name
    prefill_only = False
    rank_agent = staticmethod(DecodeRankAgent)
    servicer: DecodeServicer

    def make_servicer(self) -> DecodeServicer:
        self.traces = DecodeTraces()
        return DecodeServicer(self, self.traces)

    def add_servicer(self, server: grpc.aio.Server) -> None:
        node_pb2_grpc.add_DecodeNodeServicer_to_server(self.servicer, server)

    def receive_into(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self.core.pool.kv_caches

    def last_transfer(self) -> node_pb2.LayerTimeline | None:
        """The most recent request that received its KV over the network: when each layer
        landed."""
        for trace in reversed(self.traces.values()):
            if trace.transfer_id and trace.layer_arrived_s:
                landed = [trace.layer_arrived_s.get(i, 0.0) for i in range(self.layout.num_layers)]
                return node_pb2.LayerTimeline(
                    transfer_id=trace.transfer_id,
                    request_id=trace.request_id,
                    landed_s=landed,
                    marks_s=trace.marks_s,
                )
        return None

    def role_stats(self, stats: EngineStats) -> dict[str, int]:
        return {"num_local_prefills": self.servicer.counters.num_local_prefills}

    def role_metric_counters(self) -> dict[str, int]:
        return {"num_fallbacks": self.servicer.counters.num_fallbacks}

    async def abort(self, request_id: str) -> bool:
        return await self.servicer.abort(request_id)
