"""RedisNodeSource: the router's live view of the Redis registry (see router/README.md).

```
watch(on_nodes)
  _listen task:  SUBSCRIBE pdserve:node-events ── join ──► wake
                                               └─ leave ─► drop the node now, wake
  every heartbeat_s, or woken:  resync ──► on_nodes(every record)
resync:  INFO server (run_id) + SCAN pdserve:node:* + MGET ──► the view
  Redis away:                      the view stays; logged once
  Redis back, or restarted:        for ttl_s, records missing from Redis are kept (their
                                   nodes re-register within a heartbeat); logged once
```

Every call is bounded (asyncio.timeout, from the registry's timeout_s); nothing here is on a
request's path.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time

from pdserve.config import RegistryConfig
from pdserve.registry import (
    EVENTS_CHANNEL,
    NODE_KEY_PATTERN,
    REGISTRY_ERRORS,
    NodeRecord,
    check_record,
    registry_client,
)
from pdserve.security import ClusterAuth
from router.node_source import NodeAddress, NodeSource, OnNodes

logger = logging.getLogger(__name__)

_SCAN_COUNT = 256  # keys per SCAN round trip
_RESYNC_CALLS = 4  # a resync's budget, in registry timeouts (INFO, SCAN..., MGET)


class RedisNodeSource(NodeSource):
    """The nodes registered in Redis. Construct it inside the event loop it runs on."""

    def __init__(self, config: RegistryConfig, auth: ClusterAuth | None = None) -> None:
        """`auth`: admit only records signed with the cluster secret (None: any record)."""
        self.config = config
        self._auth = auth
        self._redis = registry_client(config)
        self._records: dict[str, NodeRecord] = {}  # by node id: the last view
        self._bad_keys: set[bytes] = set()  # unreadable records, logged once each
        self._reachable: bool | None = None  # None: not tried yet
        self._run_id: str | None = None  # Redis's; a new one means it restarted
        self._keep_missing_until_s = 0.0  # monotonic; see resync
        self._wake = asyncio.Event()

    @property
    def reachable(self) -> bool:
        return bool(self._reachable)

    def nodes(self) -> list[NodeAddress]:
        """The current view."""
        return [NodeAddress.from_record(record) for record in self._records.values()]

    async def list_nodes(self) -> list[NodeAddress]:
        await self.resync()
        return self.nodes()

    async def watch(self, on_nodes: OnNodes) -> None:
        listener = asyncio.create_task(self._listen(), name="registry-events")
        try:
            while True:
                # asyncio.timeout, not wait_for: Python 3.11's wait_for can turn a cancel that
                # lands as it times out into TimeoutError, which would be swallowed here.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.config.heartbeat_s):
                        await self._wake.wait()
                self._wake.clear()
                if await self.resync():
                    await on_nodes(self.nodes())
        finally:
            listener.cancel()
            await asyncio.gather(listener, return_exceptions=True)

    async def close(self) -> None:
        await self._redis.aclose()

    async def resync(self) -> bool:
        """Reads every record into the view; False (the view unchanged) when Redis is away."""
        try:
            async with asyncio.timeout(_RESYNC_CALLS * self.config.timeout_s):
                run_id = (await self._redis.info("server"))["run_id"]
                records = await self._read_records()
        except REGISTRY_ERRORS as error:
            self._on_unreachable(error)
            return False
        self._on_reachable(run_id)
        if time.monotonic() < self._keep_missing_until_s:
            records = {**self._records, **records}
        self._records = records
        return True

    async def _read_records(self) -> dict[str, NodeRecord]:
        keys = [key async for key in self._redis.scan_iter(NODE_KEY_PATTERN, count=_SCAN_COUNT)]
        values = await self._redis.mget(keys) if keys else []
        records = {}
        for key, value in zip(keys, values):
            if value is None:  # expired between SCAN and MGET
                continue
            try:
                record = NodeRecord.from_json(value)
                reason = check_record(self._auth, record) if self._auth is not None else None
                if reason is not None:
                    raise ValueError(f"not admitted: {reason}")
            except ValueError as error:
                if key not in self._bad_keys:
                    logger.warning("registry record %s ignored: %s", key.decode(), error)
                    self._bad_keys.add(key)
                continue
            records[record.node_id] = record
        self._bad_keys &= set(keys)
        return records

    async def _listen(self) -> None:
        """Wakes the resync on every join/leave event; drops a leaving node at once."""
        while True:
            pubsub = self._redis.pubsub()
            try:
                async with asyncio.timeout(self.config.timeout_s):
                    await pubsub.subscribe(EVENTS_CHANNEL)
                while True:  # get_message's own timeout is an asyncio.timeout
                    message = await pubsub.get_message(
                        ignore_subscribe_messages=True, timeout=self.config.heartbeat_s
                    )
                    if message is not None:
                        self._on_event(message["data"])
            except REGISTRY_ERRORS as error:
                self._on_unreachable(error)
            finally:
                with contextlib.suppress(*REGISTRY_ERRORS):
                    async with asyncio.timeout(self.config.timeout_s):
                        await pubsub.aclose()
            await asyncio.sleep(self.config.heartbeat_s)

    def _on_event(self, data: bytes) -> None:
        try:
            event = json.loads(data)
            kind, node_id = event["event"], event["node_id"]
        except (ValueError, KeyError, TypeError):
            logger.warning("registry event %r ignored: not {event, node_id} JSON", data)
            return
        if kind == "leave":
            self._records.pop(node_id, None)
        self._wake.set()

    def _on_unreachable(self, error: BaseException) -> None:
        if self._reachable is not False:
            logger.warning(
                "registry %s unreachable (%s: %s): routing on the last view of %d nodes; "
                "retrying every %s s",
                self.config.redacted_url, type(error).__name__, error, len(self._records),
                self.config.heartbeat_s,
            )  # fmt: skip
        self._reachable = False

    def _on_reachable(self, run_id: str) -> None:
        restarted = self._run_id is not None and run_id != self._run_id
        if self._reachable is False or restarted:
            self._keep_missing_until_s = time.monotonic() + self.config.ttl_s
            logger.warning(
                "registry %s reachable again%s: nodes have %s s to re-register",
                self.config.redacted_url, " (it restarted)" if restarted else "", self.config.ttl_s,
            )  # fmt: skip
        self._reachable = True
        self._run_id = run_id
