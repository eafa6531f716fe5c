"""`PrefillRankAgent`: the prefill role on a tensor-parallel node's other ranks (1..N-1), in
the rank's own process (node_common/tp/rank_worker.py runs it beside the engine's worker loop).

```
engine hook (this rank's)   a LayerStreamer over this rank's pool, opening every request the
                            engine computes (rank 0 says which requests hand off only once
                            it has the ticket): each layer packed as it is computed, kept
SendKV(request, ticket)     the routes leaving this rank (FanOutSender: the ticket checked
                            here too) take the request's layers, those packed and those to
                            come, straight to the decode ranks; ProgressBeats tell them
                            while this rank's engine progresses (as on rank 0)
the routes end ──► Done(ok | why, bytes) to rank 0
Abort(transfer_id)          the routes fail (their receivers told); Done follows
CloseRequest(request)       rank 0's call ended: the request's layers are dropped
```
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from cache_transfer import KVLayout, KVTransferManager, TransferState
from cache_transfer.tp import FanOutSender, RankHeads, TicketRefused
from engine.distributed import partition_model
from engine.engine_core import EngineCore
from engine.outputs import PrefillLayerChunk
from node_common.tp.rank_messages import Abort, CloseRequest, Done, RankReport, SendKV
from pdserve.v1 import node_pb2
from prefill_node.layer_streamer import LayerStreamer
from prefill_node.progress_beats import ProgressBeats

logger = logging.getLogger(__name__)


class PrefillRankAgent:
    receives_kv: ClassVar[bool] = False

    def __init__(
        self,
        core: EngineCore,
        manager: KVTransferManager,
        layout: KVLayout,
        heads: RankHeads,
        report: Callable[[Done], None],
    ) -> None:
        self._manager = manager
        self._layout = layout
        self._heads = heads
        self._report = report
        assert core.tp is not None
        n = core.tp.world_size
        shards = [partition_model(core.arch, r, n).shard for r in range(n)]
        self._prefill_ranks = [RankHeads(s.rank, s.kv_head_start, s.kv_head_end) for s in shards]
        rank_layout = layout.with_heads(heads.kv_head_end - heads.kv_head_start)
        loop = asyncio.get_running_loop()
        self.streamer = LayerStreamer(core.pool.kv_caches, rank_layout, loop, auto_open=True)
        beats = ProgressBeats(loop, self.streamer.progress)  # (this rank's routes)

        def on_layer_done(layer_idx: int, chunks: Sequence[PrefillLayerChunk]) -> None:
            self.streamer.on_layer_done(layer_idx, chunks)
            beats.on_layer_done(layer_idx, chunks)

        core.on_layer_done = on_layer_done  # (before the engine is ready)
        self._fan_outs: dict[str, FanOutSender] = {}

    async def handle(self, message: Any) -> Any:
        if isinstance(message, SendKV):
            self._send(message)
        elif isinstance(message, Abort):
            fan_out = self._fan_outs.get(message.transfer_id)
            if fan_out is not None:
                fan_out.abort(message.reason)
        elif isinstance(message, CloseRequest):
            self.streamer.close(message.request_id, message.reason)
        else:
            raise ValueError(f"a prefill rank takes no {type(message).__name__}")
        return None

    def report(self) -> RankReport:
        return RankReport(
            self._heads.rank, self._manager.num_pending, len(self._fan_outs),
            self.streamer.num_open,
        )  # fmt: skip

    async def shutdown(self, reason: str) -> None:
        for fan_out in list(self._fan_outs.values()):
            fan_out.abort(reason)

    def _send(self, message: SendKV) -> None:
        ticket = node_pb2.TransferTicket.FromString(message.ticket)
        transfer_id = ticket.transfer_id
        try:
            fan_out = FanOutSender.create(
                self._manager, ticket, self._layout, self._heads, self._prefill_ranks,
                message.timeout_s, message.ceiling_s, message.request_id,
            )  # fmt: skip
        except TicketRefused as error:
            self._report(Done(transfer_id, False, str(error), 0))
            return
        self._fan_outs[transfer_id] = fan_out

        def done(_: object) -> None:
            self._fan_outs.pop(transfer_id, None)
            ok = fan_out.state == TransferState.SUCCESS
            self._report(Done(transfer_id, ok, fan_out.error or "", fan_out.num_bytes_sent))

        fan_out.add_finish_callback(done)
        self.streamer.open_if_needed(message.request_id, ticket.num_tokens)
        self.streamer.attach(message.request_id, fan_out)
