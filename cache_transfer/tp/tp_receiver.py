"""`TPReceiver`: a decode node's whole KV hand-off, on its rank 0 (what the decode node awaits
in place of one `KVReceiver`), whatever the two nodes' tensor-parallel sizes.

```
decode TP 1   the KVReceiver of a TP 1 hand-off (today's: its ticket, its bytes, writes in
              place), and a FanIn beside it for a prefill node of TP > 1: that node's first
              route retires the KVReceiver (unused: counted nowhere, nobody told), and the
              FanIn's routes are the hand-off
decode TP b   the ticket lists every rank (address, kv heads; signed); rank 0's FanIn, and one
              RemotePart per other rank (whole.add_remote: the node opens that rank's FanIn
              and carries its report), sealed once all joined (WholeHandOff)
```

SUCCESS once every part succeeded and rank 0 holds the first token; any part failing fails the
rest (their peers told). `writes_settled`: no write of any rank can land any more (a failed
hand-off's blocks are freed only then).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Sequence

from cache_transfer.kv_transfer_manager import KVTransferManager
from cache_transfer.layout import KVCaches, KVLayout
from cache_transfer.receiver import KVReceiver, LayerCallback
from cache_transfer.state import TransferState
from cache_transfer.tickets import issue_ticket
from cache_transfer.tp.fan_in import FanIn
from cache_transfer.tp.route_tickets import DecodeRank, rank_endpoints
from cache_transfer.tp.whole_hand_off import WholeHandOff
from pdserve.v1 import node_pb2, transfer_pb2


class TPReceiver:
    def __init__(
        self,
        manager: KVTransferManager,
        layout: KVLayout,
        ranks: Sequence[DecodeRank],
        kv_caches: KVCaches,
        dst_block_ids: Sequence[int],
        num_tokens: int,
        timeouts_s: tuple[float, float | None],  # (timeout_s, max_ceiling_s)
        log_id: str = "",
        num_cached_blocks: int = 0,
    ) -> None:
        """`layout`: the model's (every kv head); `ranks`: this node's (one at TP 1);
        `kv_caches`: rank 0's pool; `timeouts_s`: as a KVReceiver's (no progress, at most
        this ceiling); `log_id`: the request's id; `num_cached_blocks`: the prompt's leading
        blocks held (KVSuffix: the ticket says so, every route skips them)."""
        timeout_s, max_ceiling_s = timeouts_s
        self.dst_block_ids = list(dst_block_ids)
        self.num_bytes_skipped = layout.kv_bytes(num_cached_blocks)  # held here, every head
        self.direct: KVReceiver | None = None
        self._manager = manager
        if len(ranks) == 1:
            self.direct = manager.create_receiver(
                dst_block_ids, num_tokens, timeout_s, max_ceiling_s=max_ceiling_s, log_id=log_id,
                num_cached_blocks=num_cached_blocks,
            )  # fmt: skip
            self._ticket = self.direct.ticket()
        else:
            self._ticket = issue_ticket(
                manager.auth, timeout_s, uuid.uuid4().hex, ranks[0].address, dst_block_ids,
                layout.layout_hash(), num_tokens, ranks[0].kv_device, num_cached_blocks,
                layout.dtype,
                rank_endpoints(list(ranks)),
            )  # fmt: skip
        self.transfer_id = self._ticket.transfer_id
        rank0 = DecodeRank(ranks[0].heads, self._ticket.dst_address, self._ticket.kv_device)
        self.fan_in = FanIn(
            manager, self._ticket, rank0, kv_caches, layout, timeouts_s,
            may_accept=self._direct_unused, log_id=log_id,
            on_first_route=self._take_routes if self.direct is not None else None,
        )  # fmt: skip
        ceiling_s = timeout_s if max_ceiling_s is None else max_ceiling_s
        self.whole = WholeHandOff(self, self.transfer_id, timeout_s + ceiling_s)  # + other ranks'
        self.group = self.whole.group  # this rank's part: the direct receiver or the fan-in
        self.group.add(self.direct if self.direct is not None else self.fan_in.group)
        if self.direct is not None:
            self.whole.seal()
        # the hand-off over (the TP 1 receiver's, say): the fan-in takes no route any more
        self.group.add_finish_callback(lambda _: self.fan_in.group.abort("the hand-off ended"))

    def ticket(self) -> node_pb2.TransferTicket:
        ticket = node_pb2.TransferTicket()
        ticket.CopyFrom(self._ticket)
        return ticket

    @property
    def state(self) -> TransferState:
        return self.whole.state

    @property
    def error(self) -> str | None:
        return self.whole.error

    @property
    def finished(self) -> bool:
        return self.whole.finished

    @property
    def elapsed_s(self) -> float:
        return self.whole.elapsed_s

    @property
    def writes_settled(self) -> asyncio.Event:
        return self.group.writes_settled

    @property
    def first_token(self) -> transfer_pb2.FirstToken | None:
        if self.direct is not None and self.direct in self.group.parts:
            return self.direct.first_token
        return self.fan_in.first_token

    @property
    def num_bytes_received(self) -> int:
        local = self.fan_in.num_bytes_received
        if self.direct is not None:
            local += self.direct.num_bytes_received
        return local + self.whole.remote_bytes

    def add_layer_callback(self, callback: LayerCallback) -> None:
        if self.direct is not None:
            self.direct.add_layer_callback(callback)
        self.fan_in.add_layer_callback(callback)

    def add_finish_callback(self, callback: Callable[[TPReceiver], None]) -> None:
        self.whole.add_finish_callback(callback)

    def abort(self, reason: str) -> None:
        self.whole.abort(reason)
        self.fan_in.group.abort(reason)  # (the routes it may still take: none)

    def cancel(self, reason: str) -> None:
        """`abort`, for a hand-off nobody needs any more (logged at DEBUG)."""
        self.whole.cancel(reason)
        self.fan_in.group.cancel(reason)

    async def wait(self) -> TransferState:
        return await self.whole.wait()

    def _direct_unused(self) -> bool:
        return self.direct is None or self.direct.sender_id is None

    def _take_routes(self) -> None:
        """A prefill node of TP > 1 reached a TP 1 decode node: its routes are the hand-off."""
        if self.direct is not None and self.direct in self.group.parts:
            self.group.discard(self.direct)
            self._manager.retire(self.direct, "the prefill node sends tensor-parallel routes")
            self.group.add(self.fan_in.group)
