"""`TPRanks`: rank 0's view of its node's other tensor-parallel ranks.

```
connect()       (node start) each rank's worker_init result (core.tp.worker_results): its KV
                address and device, kv heads, link; a RankLink to each
decode_ranks()  every rank's DecodeRank (a TP decode node's ticket lists them)
prefill_ranks() every rank's kv heads (a TP prefill node's route plan)
remote_part(transfer_id, rank)   that rank's share of a hand-off: ended by its Done report;
                its abort goes to the rank as Abort
a link closing while the node runs (the rank died) ─► every share of every rank fails
                ("tensor-parallel rank r is gone"), then on_failure(reason): the node stops
shutdown()      (the node stops) each rank ends its hand-offs and closes its transport
```
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cache_transfer.tp import DecodeRank, RankHeads, RemotePart
from engine.engine_core import EngineCore
from node_common.tp.rank_link import LinkClosed, RankLink, connect_link
from node_common.tp.rank_messages import Abort, Done, RankReport, RankStats, Shutdown

logger = logging.getLogger(__name__)

CALL_TIMEOUT_S = 10.0  # a rank answers a call at once (its event loop does nothing heavy)
SHUTDOWN_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class WorkerRank:
    heads: RankHeads
    address: str
    kv_device: str
    link_path: str
    link_key: bytes


class TPRanks:
    def __init__(self, core: EngineCore, on_failure: Callable[[str], None]) -> None:
        """`on_failure(reason)`: a rank is gone (the node stops); called once."""
        assert core.tp is not None
        self.world_size = core.tp.world_size
        shard = core.tp.shard
        self.rank0 = RankHeads(0, shard.kv_head_start, shard.kv_head_end)
        self.workers = [
            _worker(rank, result) for rank, result in sorted(core.tp.worker_results.items())
        ]
        self._links: dict[int, RankLink] = {}
        self._parts: dict[tuple[str, int], RemotePart] = {}
        self._on_failure = on_failure
        self.failure: str | None = None
        self._stopping = False
        self._watchers: set[asyncio.Task[None]] = set()

    async def connect(self) -> None:
        for worker in self.workers:
            rank = worker.heads.rank
            link = await connect_link(
                worker.link_path, worker.link_key, functools.partial(self._handle, rank),
                f"rank {rank} link",
            )  # fmt: skip
            self._links[rank] = link
            watcher = asyncio.get_running_loop().create_task(self._watch(rank, link))
            self._watchers.add(watcher)

    def decode_ranks(self, address: str, kv_device: str) -> list[DecodeRank]:
        """Every rank as a ticket lists it (rank 0: this node's `address`, `kv_device`)."""
        rank0 = DecodeRank(self.rank0, address, kv_device)
        return [rank0, *(DecodeRank(w.heads, w.address, w.kv_device) for w in self.workers)]

    def prefill_ranks(self) -> list[RankHeads]:
        return [self.rank0, *(w.heads for w in self.workers)]

    def remote_part(self, transfer_id: str, rank: int) -> RemotePart:
        """Rank `rank`'s share of hand-off `transfer_id` (ends at its Done report)."""
        part = RemotePart(
            transfer_id, rank, lambda reason: self.note(rank, Abort(transfer_id, reason))
        )
        self._parts[(transfer_id, rank)] = part
        if self.failure is not None:
            part.resolve(False, self.failure)
        return part

    async def call(self, rank: int, message: Any) -> Any:
        return await self._links[rank].call(message, CALL_TIMEOUT_S)

    def note(self, rank: int, message: Any) -> None:
        link = self._links.get(rank)
        if link is not None:
            link.note(message)

    def note_all(self, message: Any) -> None:
        for rank in self._links:
            self.note(rank, message)

    async def reports(self) -> list[RankReport]:
        """What every other rank holds now (LinkClosed when one does not answer)."""
        return list(await asyncio.gather(*(self.call(r, RankStats()) for r in self._links)))

    async def shutdown(self, reason: str) -> None:
        """(the node stops) Each rank ends its hand-offs and closes its transport; the links
        close. A rank that does not answer is left to the engine's stop."""
        self._stopping = True
        calls = [self._links[r].call(Shutdown(reason), SHUTDOWN_TIMEOUT_S) for r in self._links]
        for rank, result in zip(self._links, await asyncio.gather(*calls, return_exceptions=True)):
            if isinstance(result, BaseException):
                logger.warning("tensor-parallel rank %d did not shut down: %r", rank, result)
        for watcher in self._watchers:
            watcher.cancel()
        await asyncio.gather(*(link.close() for link in self._links.values()))
        self._fail_parts(f"the node stopped ({reason})")

    async def _handle(self, rank: int, message: Any) -> None:
        if not isinstance(message, Done):
            logger.warning("rank 0: an unexpected message from rank %d: %r", rank, message)
            return
        part = self._parts.pop((message.transfer_id, rank), None)
        if part is not None:
            part.resolve(message.ok, message.error, message.num_bytes)

    async def _watch(self, rank: int, link: RankLink) -> None:
        await link.closed.wait()
        if self._stopping or self.failure is not None:
            return
        self.failure = f"tensor-parallel rank {rank} is gone (its link to rank 0 closed)"
        logger.error("%s: the node stops", self.failure)
        self._fail_parts(self.failure)
        self._on_failure(self.failure)

    def _fail_parts(self, reason: str) -> None:
        parts, self._parts = self._parts, {}
        for part in parts.values():
            part.resolve(False, reason)


def _worker(rank: int, result: dict[str, Any]) -> WorkerRank:
    start, end = result["kv_heads"]
    return WorkerRank(
        RankHeads(rank, start, end), result["kv_address"], result["kv_device"],
        result["link_path"], result["link_key"],
    )  # fmt: skip


__all__ = ["LinkClosed", "TPRanks", "WorkerRank"]
