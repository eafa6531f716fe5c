"""`NodeBase`: what a prefill or a decode node is, less what its role does.

```
NodeBase(core, config)     inside the event loop: AsyncEngine around the EngineCore, KV layout,
                           KV transport + KVTransferManager, the role's servicer, NodeInfo,
                           tokenizer files, GrpcNodeServer (Node + the role's service + health)
start()                    engine thread, then serve (and register, with a registry); /metrics
                           on config.metrics_port unless 0 (NodeMetrics)
stop()                     end the KV-event watches (KVEventHub), stop serving (in-flight
                           calls get grace_s, then are cancelled and free what they hold),
                           the other TP ranks' hand-offs, the engine thread, the engine (its
                           TP ranks exit), the transport (live transfers fail, peers are
                           told). Idempotent.
failed                     set when the node cannot go on (a TP rank died or hung): the
                           launcher stops it
```

A role subclass says which service it serves (`role`, `role_service`, `prefill_only`), builds
its servicer (`make_servicer`), registers it (`add_servicer`), and answers `abort`; it may add
to the load report (`role_stats`) and receive KV into the engine's cache (`receive_into`).
"""

from __future__ import annotations

import abc
import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any, ClassVar

import grpc
import torch

from cache_transfer import CudaIpcSharing, KVTransferManager, make_transport
from engine.async_engine import AsyncEngine
from engine.engine_core import EngineCore, EngineStats
from engine.kv_offload import KVOffloadStats
from engine.spec_decode import SpecDecodeStats
from node_common.grpc_node_server import GrpcNodeServer
from node_common.kv_event_hub import KVEventHub
from node_common.node_messages import read_tokenizer_files
from node_common.node_metrics import NodeMetrics, loop_stats_reader, stats_fields
from node_common.role_servicer import RoleServicer
from node_common.tp.rank_worker import RankAgent, node_layout, rank_heads
from node_common.tp.tp_ranks import TPRanks
from pdserve.config import NodeConfig
from pdserve.sampling_defaults import defaults_to_proto
from pdserve.security import load_cluster_auth
from pdserve.tokenizer import Tokenizer
from pdserve.v1 import node_pb2, transfer_pb2

logger = logging.getLogger(__name__)


class NodeBase(abc.ABC):
    """One node. Construct it inside the event loop it will serve on."""

    role: ClassVar[node_pb2.NodeRole]  # node_pb2.NODE_ROLE_*
    role_service: ClassVar[str]  # the full name of the role's gRPC service
    prefill_only: ClassVar[bool]  # the role's EngineCore runs in prefill-only mode
    # what the role runs on a tensor-parallel node's other ranks (node_common/tp/rank_worker.py):
    # the agent's class, held as a staticmethod (an AgentFactory, not a method of the node)
    rank_agent: ClassVar[staticmethod[..., RankAgent]]

    def __init__(self, core: EngineCore, config: NodeConfig) -> None:
        if core.config.scheduler.prefill_only != self.prefill_only:
            build = "with" if self.prefill_only else "without"
            raise ValueError(
                f"a {self.role_name} node needs an EngineCore "
                f"{'in prefill-only mode' if self.prefill_only else 'that decodes'}: build it "
                f"{build} SchedulerConfig(prefill_only=True)"
            )
        self.core = core
        self.config = config
        # the model's KV layout in the pool's storage dtype (the model's, or FP8 with
        # --kv-cache-dtype): what tickets and handshakes compare
        self.layout = node_layout(core)
        self.engine = AsyncEngine(core)
        self.failed = asyncio.Event()  # the node cannot serve any more (a rank died, hung)
        self.failure: str | None = None
        # a tensor-parallel node: its other ranks (node_common/tp/), each with its own KV
        # transport; the hand-offs fan out to them
        self.tp_ranks = TPRanks(core, self._fail) if core.tp is not None else None
        self.auth = load_cluster_auth(config.security)
        self.metrics = NodeMetrics(
            self.role_name,
            core.loaded.name,
            loop_stats_reader(asyncio.get_running_loop(), self._metric_stats),
        )
        self.manager = self._make_manager()
        self.servicer: RoleServicer = self.make_servicer()
        self._node_info = self._make_node_info()
        tokenizer_dir = core.loaded.tokenizer_dir
        chat_template = Tokenizer.from_dir(tokenizer_dir).chat_template if tokenizer_dir else None
        self._tokenizer_files = read_tokenizer_files(tokenizer_dir, chat_template)
        self._server = GrpcNodeServer(
            config.host, config.port, self, self.role_service, self.add_servicer,
            registry=config.registry, advertise_host=config.advertise_host,
            security=config.security, auth=self.auth,
        )  # fmt: skip
        self.kv_events = KVEventHub(self.engine)  # for routers that watch (kv_events policy)
        self._engine_started = False
        self._stopped = False

    def _make_manager(self) -> KVTransferManager:
        """The KV transport (where peers reach this node) and its transfer manager."""
        config = self.config
        kv_device = self.core.pool.buffer.device
        if config.kv_encrypt and self.auth is None:
            raise ValueError("--kv-encrypt needs --cluster-secret-file (its keys come from it)")
        if config.kv_encrypt and kv_device.type != "cpu" and config.kv_transport != "tcp":
            raise ValueError(
                f"--kv-encrypt encrypts host payloads, and the {config.kv_transport} transport "
                f"sends this node's KV from {kv_device} memory: use --kv-transport tcp"
            )
        transport = make_transport(
            config.kv_transport, config.host, config.kv_port, advertise_host=config.advertise_host
        )
        in_place = config.kv_write_in_place and kv_device.type == "cuda" and self.tp_ranks is None
        sharing = CudaIpcSharing() if in_place else None  # (TP hand-offs send: routes)
        heads = rank_heads(self.core)
        rank_layout = self.layout.with_heads(heads.kv_head_end - heads.kv_head_start)
        return KVTransferManager(
            transport, rank_layout, self.receive_into(), auth=self.auth, sharing=sharing,
            kv_device=kv_device, encrypt=config.kv_encrypt,
        )  # fmt: skip

    # ---- what a role provides -------------------------------------------------------------

    @abc.abstractmethod
    def make_servicer(self) -> RoleServicer:
        """The role's servicer (built once the engine and the transfer manager exist)."""

    @abc.abstractmethod
    def add_servicer(self, server: grpc.aio.Server) -> None:
        """Register `self.servicer` on `server`."""

    @abc.abstractmethod
    async def abort(self, request_id: str) -> bool:
        """`Node.Abort`: end the request wherever it is on this node; False when unknown."""

    def receive_into(self) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """The KV caches incoming transfers land in (the decode role); None: sends only."""
        return None

    def role_stats(self, stats: EngineStats) -> dict[str, int]:
        """NodeStats fields the role reports on top of the shared ones."""
        return {}

    def last_transfer(self) -> node_pb2.LayerTimeline | None:
        """The most recent KV hand-off's per-layer timeline on this node, if any."""
        return None

    def role_metric_counters(self) -> dict[str, int]:
        """Counters the role exports as metrics beyond NodeStats (node_metrics._COUNTERS)."""
        return {}

    # ---- NodeBackend ----------------------------------------------------------------------

    @property
    def role_name(self) -> str:
        return "prefill" if self.prefill_only else "decode"

    @property
    def address(self) -> str:
        """The gRPC HOST:PORT (the bound port once started)."""
        return self._server.address

    @property
    def kv_address(self) -> str:
        """The KV transport address peers reach this node at."""
        return self.manager.address

    @property
    def node_info(self) -> node_pb2.NodeInfo:
        return self._node_info

    @property
    def tokenizer_files(self) -> node_pb2.TokenizerFiles:
        return self._tokenizer_files

    def watch_kv_events(self) -> AsyncIterator[node_pb2.KVEvents]:
        return self.kv_events.watch()

    async def stats(self, fresh: bool = True) -> node_pb2.NodeStats:
        """The node's stats; `fresh=False`: as of the engine's last step, without waiting for
        the engine thread (a long prefill step must not delay a registry heartbeat)."""
        if fresh:
            stats = await self.engine.stats()
        else:
            stats = self.engine.last_stats
        counters = self.servicer.counters
        fields: dict[str, Any] = {
            "num_kv_blocks": stats.num_total_blocks,
            "num_free_kv_blocks": stats.num_free_blocks,
            "num_running_requests": stats.num_running,
            "num_waiting_requests": stats.num_waiting,
            "num_pending_transfers": self.manager.num_pending + await self._ranks_pending(fresh),
            "num_finished_requests": counters.num_finished_requests,
            "num_failed_transfers": self.manager.num_failed,
            "num_in_place_transfers": self.manager.num_in_place,
            "num_kv_transfers": self.manager.num_succeeded,
            "num_kv_transfer_bytes": self.manager.num_bytes_moved,
            "num_kv_skipped_bytes": self.manager.num_bytes_skipped,
            "num_prefix_cache_hit_tokens": stats.prefix_cache_hit_tokens,
            "num_prefilled_tokens": stats.prompt_tokens_computed,
            "num_queued_prefill_tokens": counters.num_queued_prefill_tokens,
            **_host_tier_fields(stats.kv_offload),
            **_spec_fields(stats.spec_decode),
        }
        reply = node_pb2.NodeStats(**{**fields, **self.role_stats(stats)})
        timeline = self.last_transfer()
        if timeline is not None:
            reply.last_transfer.CopyFrom(timeline)
        return reply

    async def _ranks_pending(self, fresh: bool) -> int:
        """What the other tensor-parallel ranks hold of hand-offs: route sessions, hand-offs
        not reported, requests whose KV they keep (0 at TP 1; not asked unless `fresh`)."""
        if self.tp_ranks is None or not fresh or self.tp_ranks.failure is not None:
            return 0
        reports = await self.tp_ranks.reports()
        return sum(
            r.num_pending_transfers + r.num_open_hand_offs + r.num_open_requests for r in reports
        )

    # ---- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the engine thread, then serve. Raises OSError when the port is taken."""
        if self.tp_ranks is not None:
            await self.tp_ranks.connect()
            self.engine.add_dead_callback(lambda error: self._fail(f"the engine stopped: {error}"))
        self.engine.start()
        self._engine_started = True
        await self._server.start()
        if self.config.metrics_port:
            self.metrics.serve(self.config.host, self.config.metrics_port)
            logger.info("Prometheus metrics on %s", self.metrics.url)
        logger.info(
            "%s node serving on %s (kv %s): model %s, layout %s",
            self.role_name, self.address, self.kv_address, self.core.loaded.name,
            self.layout.layout_hash()[:12],
        )  # fmt: skip

    async def stop(self, grace_s: float | None = None) -> None:
        """Stop serving (in-flight calls get `grace_s`, default config.grace_s), then the engine
        thread and the transport. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self.kv_events.close()  # watches end now: the server's grace is for requests
        await self._server.stop(self.config.grace_s if grace_s is None else grace_s)
        self.metrics.stop()
        if self.tp_ranks is not None:
            await self.tp_ranks.shutdown("the node is stopping")
        if self._engine_started:
            await self.engine.stop()
        await asyncio.to_thread(self.core.close)  # the tensor-parallel ranks exit
        await self.manager.close()

    def _fail(self, reason: str) -> None:
        """The node cannot go on (a tensor-parallel rank died or hung): `failed` is set, the
        launcher stops it (deregistered, its transfers failed, its peers told)."""
        if self._stopped or self.failure is not None:
            return
        self.failure = reason
        logger.error("%s node fails: %s", self.role_name, reason)
        self.failed.set()

    async def _metric_stats(self) -> dict[str, int]:
        fields = stats_fields(await self.stats())
        if self.prefill_only:
            fields.pop("num_local_prefills")
        return {**fields, **self.role_metric_counters()}

    def _make_node_info(self) -> node_pb2.NodeInfo:
        arch = self.core.arch
        return node_pb2.NodeInfo(
            role=self.role,
            model_name=self.core.loaded.name,
            layout_hash=self.layout.layout_hash(),
            max_model_len=self.core.max_model_len,
            vocab_size=arch.vocab_size,
            eos_token_ids=arch.eos_token_ids,
            block_size=self.layout.block_size,
            kv_transport=self.kv_address.split("://", 1)[0],
            protocol_version=transfer_pb2.PROTOCOL_VERSION_CURRENT,
            max_num_seqs=self.core.config.scheduler.max_num_seqs,
            default_sampling=defaults_to_proto(self.core.loaded.sampling_defaults),
        )


def _host_tier_fields(tier: KVOffloadStats) -> dict[str, int]:
    """NodeStats fields of the host KV tier (engine/kv_offload; zeros when it is off)."""
    return {
        "num_host_kv_blocks": tier.num_host_blocks,
        "num_free_host_kv_blocks": tier.num_free_host_blocks,
        "num_host_prefix_cache_hit_tokens": tier.host_hit_tokens,
        "num_kv_offload_bytes": tier.offload_bytes,
        "num_kv_promotion_bytes": tier.promotion_bytes,
    }


def _spec_fields(spec: SpecDecodeStats) -> dict[str, int]:
    """NodeStats fields of speculative decoding (engine/spec_decode; zeros when it is off)."""
    return {
        "num_spec_verifies": spec.num_verifies,
        "num_spec_draft_tokens": spec.num_draft_tokens,
        "num_spec_accepted_tokens": spec.num_accepted_tokens,
        "num_spec_emitted_tokens": spec.num_emitted_tokens,
    }
