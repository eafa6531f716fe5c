"""`KVEventHub`: a node's prefix-cache events for the routers that watch it
(`Node.WatchKVEvents`; the engine's side is engine/kv_events.py).

```
watch()  a watcher joins ─► the poller runs (one task while anyone watches):
           every POLL_S: AsyncEngine.kv_events(snapshot=a watcher waits for one)
             watchers waiting ─► reset + every hash held (a snapshot: the state after the
                                 batch), in messages of at most MAX_HASHES_PER_MESSAGE
             the others       ─► the batch (stored, removed), when it holds anything
         each watcher's messages numbered 1, 2, ... (seq), all with the node's epoch
a watcher MAX_QUEUED batches behind (a slow router) ─► its queue dropped, a fresh snapshot
close()  every watch ends (the node stops: its gRPC server need not wait for them)
```
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from engine.async_engine import AsyncEngine, EngineDeadError
from engine.kv_events import KVEventBatch
from pdserve.v1 import node_pb2

logger = logging.getLogger(__name__)

POLL_S = 0.05  # how often the engine's changes are read while anyone watches
MAX_HASHES_PER_MESSAGE = 1 << 15  # 1 MiB of digests: under gRPC's default 4 MiB per message
MAX_QUEUED = 64  # batches a watcher may fall behind before it is resynced with a snapshot


@dataclass(eq=False)  # one per stream, kept in a set
class _Watcher:
    queue: asyncio.Queue[list[node_pb2.KVEvents] | None] = field(default_factory=asyncio.Queue)
    needs_snapshot: bool = True

    def put(self, messages: list[node_pb2.KVEvents]) -> None:
        if self.queue.qsize() >= MAX_QUEUED:
            while not self.queue.empty():  # behind: a snapshot replaces what it missed
                self.queue.get_nowait()
            self.needs_snapshot = True
            return
        self.queue.put_nowait(messages)


class KVEventHub:
    def __init__(self, engine: AsyncEngine, poll_s: float = POLL_S) -> None:
        self.epoch = uuid.uuid4().hex
        self._engine = engine
        self._poll_s = poll_s
        self._watchers: set[_Watcher] = set()
        self._poller: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def num_watchers(self) -> int:
        return len(self._watchers)

    async def watch(self) -> AsyncIterator[node_pb2.KVEvents]:
        """A snapshot, then the changes, until the node stops (or the caller goes away)."""
        if self._closed:
            return
        watcher = _Watcher()
        self._watchers.add(watcher)
        if self._poller is None or self._poller.done():
            self._poller = asyncio.get_running_loop().create_task(self._poll(), name="kv-events")
        seq = 0
        try:
            while (messages := await watcher.queue.get()) is not None:
                for message in messages:
                    seq += 1
                    message.seq = seq
                    yield message
        finally:
            self._watchers.discard(watcher)

    def close(self) -> None:
        """End every watch now; later ones end at once."""
        self._closed = True
        for watcher in self._watchers:
            watcher.queue.put_nowait(None)
        if self._poller is not None:
            self._poller.cancel()

    async def _poll(self) -> None:
        try:
            while self._watchers and not self._closed:
                snapshot = any(w.needs_snapshot for w in self._watchers)
                batch, held = await self._engine.kv_events(snapshot)
                self._deliver(batch, held)
                await asyncio.sleep(self._poll_s)
        except EngineDeadError:
            self.close()
        except asyncio.CancelledError:
            pass
        except Exception:  # a bug: the watchers start over (their streams end)
            logger.exception("kv events: reading the engine's changes failed")
            for watcher in self._watchers:
                watcher.queue.put_nowait(None)

    def _deliver(self, batch: KVEventBatch, held: list[bytes] | None) -> None:
        changes = self._messages(batch.stored, batch.removed)
        for watcher in list(self._watchers):
            if watcher.needs_snapshot:
                if held is not None:  # (one that joined while the engine was asked: next round)
                    watcher.needs_snapshot = False
                    watcher.put(self._messages(held, [], reset=True))
            elif changes:
                watcher.put(changes)

    def _messages(
        self, stored: Sequence[bytes], removed: Sequence[bytes], reset: bool = False
    ) -> list[node_pb2.KVEvents]:
        """`stored` and `removed` in messages of at most MAX_HASHES_PER_MESSAGE hashes (none
        when both are empty, unless `reset`)."""
        step = MAX_HASHES_PER_MESSAGE
        messages = [
            node_pb2.KVEvents(epoch=self.epoch, stored=stored[i : i + step])
            for i in range(0, len(stored), step)
        ] + [
            node_pb2.KVEvents(epoch=self.epoch, removed=removed[i : i + step])
            for i in range(0, len(removed), step)
        ]
        if reset:
            messages = messages or [node_pb2.KVEvents(epoch=self.epoch)]
            messages[0].reset = True
        return messages
