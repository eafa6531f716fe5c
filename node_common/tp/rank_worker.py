"""A tensor-parallel node's other ranks (1..N-1), each in its own process: the node part that
runs beside the engine's worker loop (engine/tp_worker.py).

```
worker_init(core)  (a role's: functools.partial(start_rank, config=..., agent_type=...); it
                   runs in the rank's process, before the engine is ready)
    a thread with its own event loop: the rank's KV transport (kv_port + rank, or any free
    port) and KVTransferManager (the decode role: receiving into this rank's pool), the
    role's RankAgent (prefill: the engine's per-layer hook; decode: fan-ins), the rank link
    (rank_link.py) rank 0 connects to
    ─► returned to rank 0 (core.tp.worker_results[rank]): the rank's KV address and device,
       its kv heads, where its link listens and the link's key
link messages (rank_messages.py) ─► the agent; its reports (Done) ─► rank 0
process exit (the engine stopped the rank): every hand-off of the rank ends, the transport
    closes (at most EXIT_CLOSE_S)
```
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import logging
import threading
from collections.abc import Callable
from typing import Any, ClassVar, Protocol

from cache_transfer import KVLayout, KVTransferManager, make_transport
from cache_transfer.layout import kv_device_id
from cache_transfer.tp import RankHeads
from engine.engine_core import EngineCore
from node_common.tp.rank_link import LinkServer
from node_common.tp.rank_messages import Done, RankReport, RankStats, Shutdown
from pdserve.config import NodeConfig
from pdserve.security import load_cluster_auth

logger = logging.getLogger(__name__)

SETUP_TIMEOUT_S = 60.0
EXIT_CLOSE_S = 5.0


class RankAgent(Protocol):
    """A role's part of a worker rank (prefill_node/tp_rank.py, decode_node/tp_rank.py)."""

    receives_kv: ClassVar[bool]  # its transfer manager receives into the rank's pool

    async def handle(self, message: Any) -> Any: ...
    def report(self) -> RankReport: ...
    async def shutdown(self, reason: str) -> None: ...


# (core, manager, the model's KV layout, this rank's heads, report) -> the agent
AgentFactory = Callable[
    [EngineCore, KVTransferManager, KVLayout, RankHeads, Callable[[Done], None]], RankAgent
]


def node_layout(core: EngineCore) -> KVLayout:
    """The model's KV layout (every kv head) in the pool's storage dtype (the model's, or FP8:
    --kv-cache-dtype), as tickets and handshakes compare it."""
    return KVLayout.from_dtype(
        core.pool.dtype,
        model=core.loaded.name,
        block_size=core.config.cache.block_size,
        **core.arch.layout_fields(),
    )


def rank_heads(core: EngineCore) -> RankHeads:
    """The kv heads this rank's pool holds (all of them without tensor parallelism)."""
    if core.tp is None:
        return RankHeads(0, 0, core.arch.num_kv_heads)
    shard = core.tp.shard
    return RankHeads(shard.rank, shard.kv_head_start, shard.kv_head_end)


def start_rank(core: EngineCore, config: NodeConfig, agent_type: AgentFactory) -> dict[str, Any]:
    """A role's worker_init (see the module doc): what rank 0 needs of this rank."""
    runtime = _RankRuntime(core, config, agent_type)
    return runtime.start()


class _RankRuntime:
    def __init__(self, core: EngineCore, config: NodeConfig, agent_type: AgentFactory) -> None:
        self.core = core
        self.config = config
        self.agent_type = agent_type
        self.loop = asyncio.new_event_loop()
        self.heads = rank_heads(core)
        self.link_server: LinkServer | None = None
        self.manager: KVTransferManager | None = None
        self.agent: RankAgent | None = None

    def start(self) -> dict[str, Any]:
        threading.Thread(target=self.loop.run_forever, name="rank-loop", daemon=True).start()
        setup = asyncio.run_coroutine_threadsafe(self._setup(), self.loop)
        try:
            result = setup.result(SETUP_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"rank {self.heads.rank}: its KV transport did not start") from None
        atexit.register(self._close_at_exit)
        return result

    async def _setup(self) -> dict[str, Any]:
        config, core, rank = self.config, self.core, self.heads.rank
        port = config.kv_port + rank if config.kv_port else 0
        transport = make_transport(config.kv_transport, config.host, port,
                                   advertise_host=config.advertise_host)  # fmt: skip
        layout = node_layout(core)
        rank_layout = layout.with_heads(self.heads.kv_head_end - self.heads.kv_head_start)
        caches = core.pool.kv_caches if getattr(self.agent_type, "receives_kv", False) else None
        auth = load_cluster_auth(config.security)
        self.manager = KVTransferManager(transport, rank_layout, caches, auth=auth)
        self.agent = self.agent_type(core, self.manager, layout, self.heads, self._report)
        self.link_server = LinkServer(self._handle, f"rank {rank} link")
        await self.link_server.start()
        logger.info("rank %d: KV transport %s, kv heads [%d, %d)", rank, self.manager.address,
                    self.heads.kv_head_start, self.heads.kv_head_end)  # fmt: skip
        return {
            "kv_address": self.manager.address,
            "kv_device": kv_device_id(core.pool.buffer.device),
            "kv_heads": (self.heads.kv_head_start, self.heads.kv_head_end),
            "link_path": self.link_server.path,
            "link_key": self.link_server.key,
        }

    async def _handle(self, message: Any) -> Any:
        assert self.agent is not None and self.manager is not None
        if isinstance(message, RankStats):
            return self.agent.report()
        if isinstance(message, Shutdown):
            await self._close(message.reason)
            return None
        return await self.agent.handle(message)

    def _report(self, done: Done) -> None:
        link = self.link_server.link if self.link_server is not None else None
        if link is None:
            logger.warning("rank %d: no link to rank 0 for %r", self.heads.rank, done)
            return
        link.note(done)

    async def _close(self, reason: str) -> None:
        if self.agent is not None:
            await self.agent.shutdown(reason)
        if self.manager is not None:
            await self.manager.close()
            self.manager = None

    def _close_at_exit(self) -> None:
        """The process exits (the engine stopped this rank): end what it holds, bounded."""
        if not self.loop.is_running():
            return
        closing = asyncio.run_coroutine_threadsafe(self._close_all(), self.loop)
        try:
            closing.result(EXIT_CLOSE_S)
        except Exception as error:  # noqa: BLE001 - exiting anyway
            logger.warning("rank %d: closing at exit: %r", self.heads.rank, error)
        self.loop.call_soon_threadsafe(self.loop.stop)

    async def _close_all(self) -> None:
        await self._close("the node is stopping")
        if self.link_server is not None:
            await self.link_server.close()
