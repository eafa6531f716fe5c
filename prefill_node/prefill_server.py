"""`PrefillServer`: one prefill node (see README.md for a request's lifecycle).

PrefillServer(core, config)   a NodeBase (node_common) around a prefill-only EngineCore, with
                              a LayerStreamer and ProgressBeats as the engine's on_layer_done
                              hook,
                              serving PrefillNode (Prefill) through a PrefillServicer; start/stop
                              as every node
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Sequence

import grpc

from engine.engine_core import EngineStats
from engine.outputs import PrefillLayerChunk
from node_common.node_base import NodeBase
from pdserve.v1 import node_pb2, node_pb2_grpc
from prefill_node.layer_streamer import LayerStreamer
from prefill_node.prefill_servicer import PrefillServicer
from prefill_node.progress_beats import ProgressBeats
from prefill_node.tp_rank import PrefillRankAgent
from prefill_node.transfer_trace import TransferTrace


class PrefillServer(NodeBase):
    """A prefill node: construct inside the event loop it will serve on; `core` must run in
    prefill-only mode (`SchedulerConfig(prefill_only=True)`)."""

    role = node_pb2.NODE_ROLE_PREFILL
    role_service = node_pb2.DESCRIPTOR.services_by_name["PrefillNode"].full_name
    prefill_only = True
    rank_agent = staticmethod(PrefillRankAgent)
    servicer: PrefillServicer

    def make_servicer(self) -> PrefillServicer:
        loop = asyncio.get_running_loop()
        self.streamer = LayerStreamer(  # (this rank's heads: the manager's layout)
            self.core.pool.kv_caches, self.manager.layout, loop
        )
        beats = ProgressBeats(loop, self.streamer.progress)

        def on_layer_done(layer_idx: int, chunks: Sequence[PrefillLayerChunk]) -> None:
            self.streamer.on_layer_done(layer_idx, chunks)
            beats.on_layer_done(layer_idx, chunks)

        self.core.on_layer_done = on_layer_done
        return PrefillServicer(self, self.streamer)

    def add_servicer(self, server: grpc.aio.Server) -> None:
        node_pb2_grpc.add_PrefillNodeServicer_to_server(self.servicer, server)

    @property
    def traces(self) -> OrderedDict[str, TransferTrace]:
        """Per transfer id (the most recent ones): when each layer was computed and sent."""
        return self.streamer.traces

    def last_transfer(self) -> node_pb2.LayerTimeline | None:
        if not self.streamer.traces:
            return None
        trace = next(reversed(self.streamer.traces.values()))
        return node_pb2.LayerTimeline(
            transfer_id=trace.transfer_id,
            request_id=trace.request_id,
            computed_s=[t or 0.0 for t in trace.layer_computed_s],
            sent_s=[t or 0.0 for t in trace.layer_sent_s],
            marks_s=trace.marks_s,
        )

    def role_stats(self, stats: EngineStats) -> dict[str, int]:
        # a prefilled request holds its blocks until its hand-off resolves
        return {"num_running_requests": stats.num_running + stats.num_prefilled_held}

    async def abort(self, request_id: str) -> bool:
        """Fail the request's transfer and abort it in the engine (freeing its blocks). Known
        here (its transfer, or its prefill's stream): answered at once; otherwise the engine's
        answer, once its step under way is done."""
        if self.streamer.abort(request_id, "aborted by the router"):
            self.engine.abort_nowait(request_id)
            return True
        return await self.engine.abort(request_id)
