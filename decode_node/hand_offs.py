"""`HandOffs`: the decode node's KV hand-offs, opened over every tensor-parallel rank.

```
open(block_ids, num_tokens, (timeout_s, max_ceiling_s), request_id) -> TPReceiver
    (the blocks reserved on rank 0; the timeouts: a KVReceiver's)
    TP 1: today's KVReceiver (its ticket), and a fan-in for a prefill node of TP > 1
    TP b: a ticket listing every rank (address, kv heads); rank 0's fan-in; each other rank's
          share (RemotePart) joined, then that rank told to open its fan-in (OpenFanIn, a call:
          the ticket leaves only once every rank can take its routes); a rank that cannot:
          the hand-off fails at once (the request prefills locally)
find(transfer_id)   the open hand-off CancelTransfer names
```
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from cache_transfer import KVTransferManager
from cache_transfer.layout import KVLayout, kv_device_id
from cache_transfer.tp import DecodeRank, TPReceiver
from node_common.node_base import NodeBase
from node_common.tp.rank_link import LinkClosed
from node_common.tp.rank_messages import OpenFanIn
from node_common.tp.rank_worker import rank_heads
from node_common.tp.tp_ranks import TPRanks


class HandOffs:
    def __init__(self, node: NodeBase, manager: KVTransferManager) -> None:
        self._node = node
        self._manager = manager
        self._layout: KVLayout = node.layout
        self._kv_device = kv_device_id(node.core.pool.buffer.device)
        self._open: dict[str, TPReceiver] = {}

    async def open(
        self,
        block_ids: Sequence[int],
        num_tokens: int,
        timeouts_s: tuple[float, float | None],
        request_id: str = "",
        num_cached_blocks: int = 0,
    ) -> TPReceiver:
        """A hand-off into `block_ids` on every rank (see the module doc), after the prompt's
        first `num_cached_blocks` (held: KVSuffix; TP 1 only, DecodeServicer)."""
        tp_ranks = self._node.tp_ranks
        address = self._manager.address
        ranks = (
            tp_ranks.decode_ranks(address, self._kv_device) if tp_ranks is not None
            else [DecodeRank(rank_heads(self._node.core), address, self._kv_device)]
        )  # fmt: skip
        receiver = TPReceiver(
            self._manager, self._layout, ranks, self._node.core.pool.kv_caches, block_ids,
            num_tokens, timeouts_s, request_id, num_cached_blocks,
        )  # fmt: skip
        self._open[receiver.transfer_id] = receiver
        receiver.add_finish_callback(lambda r: self._forget(r.transfer_id))
        if tp_ranks is not None:
            await self._open_ranks(tp_ranks, receiver, timeouts_s, request_id)
        return receiver

    def find(self, transfer_id: str) -> TPReceiver | None:
        return self._open.get(transfer_id)

    def _forget(self, transfer_id: str) -> None:
        self._open.pop(transfer_id, None)

    async def _open_ranks(
        self,
        tp_ranks: TPRanks,
        receiver: TPReceiver,
        timeouts_s: tuple[float, float | None],
        request_id: str,
    ) -> None:
        transfer_id = receiver.transfer_id
        for worker in tp_ranks.workers:
            receiver.whole.add_remote(tp_ranks.remote_part(transfer_id, worker.heads.rank))
        receiver.whole.seal()
        opening = OpenFanIn(receiver.ticket().SerializeToString(), *timeouts_s, request_id)
        calls = [tp_ranks.call(w.heads.rank, opening) for w in tp_ranks.workers]
        for result in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(result, (LinkClosed, RuntimeError)):
                receiver.abort(f"a tensor-parallel rank could not open the hand-off: {result}")
            elif isinstance(result, BaseException):
                raise result
