"""`KVEventWatchers`: one `Node.WatchKVEvents` stream per node the router routes to, feeding
a `KVEventIndex` (the `kv_events` policy's).

```
follow(clients)   the ready nodes now (on every registry change): a watch starts for each new
                  one; a node gone (or replaced by a new client) is forgotten, its watch ends
per node, until it is no longer followed:
  WatchKVEvents ──► message 1 must reset (a snapshot), then seq 1, 2, 3, ... of one epoch:
                    index.reset / index.apply
  the stream ends or fails (the node restarted, stopped, a connection broke), a seq gap, an
  epoch change without a reset, a node over the index's bound
                ──► index.forget(node) (routing sees it hold nothing), retry after RETRY_S,
                    doubling to MAX_RETRY_S (reset once a stream delivers): a fresh snapshot
close()           every watch ends
```

A node's stream carries its state (a snapshot, then changes), so nothing is lost across a
reconnect or a node restart: the index starts over from the new snapshot.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable

import grpc

from pdserve.v1 import node_pb2
from router.node_client import NodeClient
from router.policies.kv_event_index import IndexOverflow, KVEventIndex

logger = logging.getLogger(__name__)

RETRY_S = 0.2
MAX_RETRY_S = 5.0


class StreamBroken(Exception):
    """The events of a stream cannot be trusted to continue the index (the watch starts over)."""


class KVEventWatchers:
    def __init__(self, index: KVEventIndex, retry_s: float = RETRY_S) -> None:
        self.index = index
        self._retry_s = retry_s
        self._clients: dict[str, NodeClient] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self.epochs: dict[str, str] = {}  # node address -> the epoch of its current stream

    @property
    def watched(self) -> list[str]:
        return list(self._tasks)

    def follow(self, clients: Iterable[NodeClient]) -> None:
        """Watch exactly `clients` (by address; a new client for an address replaces the old)."""
        wanted = {client.address: client for client in clients}
        for address in list(self._tasks):
            if wanted.get(address) is not self._clients[address]:
                self._stop(address)
        for address, client in wanted.items():
            if address not in self._tasks:
                self._clients[address] = client
                task = asyncio.get_running_loop().create_task(
                    self._watch(client), name=f"kv-events {address}"
                )
                self._tasks[address] = task

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        for address in list(self._tasks):
            self._stop(address)
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _stop(self, address: str) -> None:
        self._tasks.pop(address).cancel()
        del self._clients[address]
        self.epochs.pop(address, None)
        self.index.forget(address)

    async def _watch(self, client: NodeClient) -> None:
        delay_s = self._retry_s
        while True:
            try:
                if await self._stream(client):
                    delay_s = self._retry_s  # it delivered: the next failure retries soon
                reason = "the stream ended"
            except grpc.aio.AioRpcError as error:
                reason = f"{error.code().name}: {error.details()}"
            except (StreamBroken, IndexOverflow) as error:
                reason = str(error)
            except Exception as error:  # e.g. the node's channel closed: follow() ends us
                reason = repr(error)
            self.index.forget(client.address)
            self.epochs.pop(client.address, None)
            logger.info("kv events of %s: %s; watching again in %.1f s", client.address,
                        reason, delay_s)  # fmt: skip
            await asyncio.sleep(delay_s)
            delay_s = min(2 * delay_s, MAX_RETRY_S)

    async def _stream(self, client: NodeClient) -> bool:
        """Feed the index from one stream until it ends; whether it delivered anything."""
        address = client.address
        call = client.node_stub.WatchKVEvents(node_pb2.WatchKVEventsRequest())
        expected_seq, epoch = 1, ""
        try:
            async for message in call:
                if message.seq != expected_seq:
                    raise StreamBroken(f"events {expected_seq}..{message.seq - 1} are missing")
                if message.reset:
                    epoch = message.epoch
                    self.index.reset(address)
                    self.epochs[address] = epoch
                elif expected_seq == 1 or message.epoch != epoch:
                    raise StreamBroken("events without the snapshot they continue")
                self.index.apply(address, message.stored, message.removed)
                expected_seq += 1
        finally:
            call.cancel()
        return expected_seq > 1
