"""`NodeRegistrar`: keeps one node's record in the Redis registry (both roles).

```
start()     first heartbeat (a failure is logged, not raised: the node serves on and retries)
            ──► heartbeat task
heartbeat   every heartbeat_s: make_record() ──► SET pdserve:node:<id> json PX ttl_s
            first success, or first after a failure ──► PUBLISH join; logged
            failure ──► logged once until the next success
stop()      cancel the heartbeat ──► DEL key + PUBLISH leave (bounded) ──► close the client
```

Redis restarted: the next SET re-creates the record; nothing else to do. Torch-free.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from pdserve.config import RegistryConfig
from pdserve.registry import (
    EVENTS_CHANNEL,
    REGISTRY_ERRORS,
    NodeRecord,
    event_message,
    node_key,
    registry_client,
)

logger = logging.getLogger(__name__)


class NodeRegistrar:
    """Registers a node, refreshes its record every heartbeat, and deregisters it on stop.
    Construct it inside the event loop it runs on."""

    def __init__(
        self,
        config: RegistryConfig,
        node_id: str,
        make_record: Callable[[], Awaitable[NodeRecord]],
    ) -> None:
        self.config = config
        self.node_id = node_id
        self._make_record = make_record
        self._redis = registry_client(config)
        self._task: asyncio.Task[None] | None = None
        self.registered = False  # the last heartbeat succeeded
        self.num_heartbeats = 0  # successful ones
        self._failing = False  # a failure was logged; the next success is logged too

    @property
    def key(self) -> str:
        return node_key(self.node_id)

    async def start(self) -> None:
        """The first heartbeat (bounded by the Redis timeout), then one every heartbeat_s."""
        await self.heartbeat()
        self._task = asyncio.create_task(self._run(), name=f"registrar-{self.node_id}")

    async def stop(self) -> None:
        """Stops heartbeating and removes the record, so routers stop sending requests here
        before the node drains. Bounded: a Redis that is away only delays it by its timeout."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        try:
            async with asyncio.timeout(2 * self.config.timeout_s):
                await self._redis.delete(self.key)
                await self._redis.publish(EVENTS_CHANNEL, event_message("leave", self.node_id))
            logger.info("deregistered node %s from %s", self.node_id, self.config.redacted_url)
        except REGISTRY_ERRORS as error:
            logger.warning(
                "could not deregister node %s from %s (%s): its record expires in %s s",
                self.node_id, self.config.redacted_url, _describe(error), self.config.ttl_s,
            )  # fmt: skip
        finally:
            self.registered = False
            await self._redis.aclose()

    async def heartbeat(self) -> bool:
        """Writes the record once; True on success. Never raises for Redis being away."""
        record = await self._make_record()
        ttl_ms = int(self.config.ttl_s * 1000)
        try:
            async with asyncio.timeout(2 * self.config.timeout_s):
                await self._redis.set(self.key, record.to_json(), px=ttl_ms)
                if not self.registered:
                    await self._redis.publish(EVENTS_CHANNEL, event_message("join", self.node_id))
        except REGISTRY_ERRORS as error:
            self._on_failure(error)
            return False
        if not self.registered:
            again = " again" if self._failing else ""
            logger.info(
                "registered %s node %s (%s) in %s%s",
                record.role, self.node_id, record.address, self.config.redacted_url, again,
            )  # fmt: skip
        self.registered = True
        self._failing = False
        self.num_heartbeats += 1
        return True

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.config.heartbeat_s)
            await self.heartbeat()

    def _on_failure(self, error: BaseException) -> None:
        self.registered = False
        if not self._failing:
            logger.warning(
                "registry %s unreachable (%s): node %s serves on and retries every %s s",
                self.config.redacted_url, _describe(error), self.node_id, self.config.heartbeat_s,
            )  # fmt: skip
        self._failing = True


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
