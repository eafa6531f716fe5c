"""`DecodeRankAgent`: the decode role on a tensor-parallel node's other ranks (1..N-1), in the
rank's own process (node_common/tp/rank_worker.py runs it beside the engine's worker loop).

```
OpenFanIn(ticket, timeouts)   rank 0 reserved the blocks and issued the ticket (every rank's
                              address and heads): a FanIn takes the routes that reach this
                              rank, into its pool's heads, only in the ticket's blocks
the fan-in ends, and nothing of it can write any more ──► Done(ok | why, bytes) to rank 0
Abort(transfer_id)            the fan-in fails (its senders told); Done follows
shutdown                      every fan-in fails ("the node is stopping")
```
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, ClassVar

from cache_transfer import KVLayout, KVTransferManager, TransferState
from cache_transfer.tp import FanIn, RankHeads, decode_ranks
from engine.engine_core import EngineCore
from node_common.tp.rank_messages import Abort, Done, OpenFanIn, RankReport
from pdserve.v1 import node_pb2

logger = logging.getLogger(__name__)


class DecodeRankAgent:
    receives_kv: ClassVar[bool] = True

    def __init__(
        self,
        core: EngineCore,
        manager: KVTransferManager,
        layout: KVLayout,
        heads: RankHeads,
        report: Callable[[Done], None],
    ) -> None:
        self._core = core
        self._manager = manager
        self._layout = layout
        self._heads = heads
        self._report = report
        self._fan_ins: dict[str, FanIn] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    async def handle(self, message: Any) -> Any:
        if isinstance(message, OpenFanIn):
            self._open(message)
        elif isinstance(message, Abort):
            fan_in = self._fan_ins.get(message.transfer_id)
            if fan_in is not None:
                fan_in.group.abort(message.reason)
        else:
            raise ValueError(f"a decode rank takes no {type(message).__name__}")
        return None

    def report(self) -> RankReport:
        return RankReport(self._heads.rank, self._manager.num_pending, len(self._fan_ins), 0)

    async def shutdown(self, reason: str) -> None:
        for fan_in in list(self._fan_ins.values()):
            fan_in.group.abort(reason)
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=5.0)

    def _open(self, message: OpenFanIn) -> None:
        ticket = node_pb2.TransferTicket.FromString(message.ticket)
        ranks = decode_ranks(ticket, self._layout.num_kv_heads)
        own = ranks[self._heads.rank]
        if own.heads != self._heads:
            raise ValueError(f"the ticket says rank {self._heads.rank} holds {own.heads}; it "
                             f"holds {self._heads}")  # fmt: skip
        if ticket.transfer_id in self._fan_ins:
            raise ValueError(f"transfer {ticket.transfer_id} is already open on this rank")
        fan_in = FanIn(
            self._manager, ticket, own, self._core.pool.kv_caches, self._layout,
            (message.timeout_s, message.max_ceiling_s), log_id=message.request_id,
        )  # fmt: skip
        self._fan_ins[ticket.transfer_id] = fan_in
        fan_in.group.add_finish_callback(lambda _: self._spawn(self._done(fan_in)))

    async def _done(self, fan_in: FanIn) -> None:
        """Report once nothing of the fan-in can write into the blocks any more."""
        await fan_in.group.writes_settled.wait()
        self._fan_ins.pop(fan_in.transfer_id, None)
        group = fan_in.group
        ok = group.state == TransferState.SUCCESS
        self._report(Done(fan_in.transfer_id, ok, group.error or "", fan_in.num_bytes_received))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
