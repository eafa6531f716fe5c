"""`DecodeServer`: one decode node (see README.md for a request's lifecycle).

DecodeServer(core, config)   inside the event loop: AsyncEngine around the EngineCore, KV
                             transport + KVTransferManager receiving into the engine's KV
                             cache, gRPC server
start()                      engine thread, then serve Node + DecodeNode + health
stop()                       stop serving (in-flight calls get grace_s, then are cancelled
                             and free what they hold), stop the engine thread, close the
                             transport (live transfers fail, peers are told)
"""

from __future__ import annotations

import logging

from cache_transfer import KVLayout, KVTransferManager, make_transport
from decode_node.decode_servicer import DecodeServicer
from decode_node.decode_trace import DecodeTraces
from engine.async_engine import AsyncEngine
from engine.engine_core import EngineCore
from engine.tokenizer import Tokenizer
from pdserve.node_messages import read_tokenizer_files
from pdserve.node_server import NodeServer, NodeServerConfig
from pdserve.v1 import node_pb2, node_pb2_grpc, transfer_pb2

logger = logging.getLogger(__name__)

DECODE_SERVICE = node_pb2.DESCRIPTOR.services_by_name["DecodeNode"].full_name


class DecodeServer:
    """A decode node: construct inside the event loop it will serve on."""

    def __init__(self, core: EngineCore, config: NodeServerConfig) -> None:
        if core.config.scheduler.prefill_only:
            raise ValueError(
                "a decode node needs an EngineCore that decodes: build it without "
                "SchedulerConfig(prefill_only=True)"
            )
        self.core = core
        self.config = config
        self.layout = KVLayout.from_dtype(
            core.dtype,
            model=core.loaded.name,
            block_size=core.config.cache.block_size,
            **core.arch.layout_fields(),
        )
        self.engine = AsyncEngine(core)
        self.traces = DecodeTraces()
        transport = make_transport(
            config.kv_transport, config.host, config.kv_port, advertise_host=config.advertise_host
        )
        self.manager = KVTransferManager(transport, self.layout, core.pool.kv_caches)
        self.servicer = DecodeServicer(
            self.engine, self.manager, self.traces, config.transfer_timeout_s
        )
        self._node_info = self._make_node_info()
        tokenizer_dir = core.loaded.tokenizer_dir
        chat_template = Tokenizer.from_dir(tokenizer_dir).chat_template if tokenizer_dir else None
        self._tokenizer_files = read_tokenizer_files(tokenizer_dir, chat_template)
        self._server = NodeServer(
            config.host,
            config.port,
            self,
            DECODE_SERVICE,
            lambda server: node_pb2_grpc.add_DecodeNodeServicer_to_server(self.servicer, server),
            registry=config.registry,
            advertise_host=config.advertise_host,
        )
        self._engine_started = False
        self._stopped = False

    @property
    def address(self) -> str:
        """The gRPC HOST:PORT (the bound port once started)."""
        return self._server.address

    @property
    def kv_address(self) -> str:
        """The KV transport address tickets carry."""
        return self.manager.address

    # ---- NodeBackend ----------------------------------------------------------------------

    @property
    def node_info(self) -> node_pb2.NodeInfo:
        return self._node_info

    @property
    def tokenizer_files(self) -> node_pb2.TokenizerFiles:
        return self._tokenizer_files

    async def stats(self) -> node_pb2.NodeStats:
        stats = await self.engine.call(lambda core: core.stats())
        counters = self.servicer.counters
        return node_pb2.NodeStats(
            num_kv_blocks=stats.num_total_blocks,
            num_free_kv_blocks=stats.num_free_blocks,
            num_running_requests=stats.num_running,
            num_waiting_requests=stats.num_waiting,
            num_pending_transfers=self.manager.num_pending,
            num_finished_requests=counters.num_finished_requests,
            num_local_prefills=counters.num_local_prefills,
            num_failed_transfers=self.manager.num_failed,
            num_prefix_cache_hit_tokens=stats.prefix_cache_hit_tokens,
            num_queued_prefill_tokens=self.servicer.counters.num_queued_prefill_tokens,
        )

    async def abort(self, request_id: str) -> bool:
        return await self.servicer.abort(request_id)

    # ---- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the engine thread, then serve. Raises OSError when the port is taken."""
        self.engine.start()
        self._engine_started = True
        await self._server.start()
        logger.info(
            "decode node serving on %s (kv %s): model %s, layout %s",
            self.address, self.kv_address, self.core.loaded.name, self.layout.layout_hash()[:12],
        )  # fmt: skip

    async def stop(self, grace_s: float | None = None) -> None:
        """Stop serving (in-flight calls get `grace_s`, default config.grace_s), then the engine
        thread and the transport. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        await self._server.stop(self.config.grace_s if grace_s is None else grace_s)
        if self._engine_started:
            await self.engine.stop()
        await self.manager.close()

    def _make_node_info(self) -> node_pb2.NodeInfo:
        arch = self.core.arch
        return node_pb2.NodeInfo(
            role=node_pb2.NODE_ROLE_DECODE,
            model_name=self.core.loaded.name,
            layout_hash=self.layout.layout_hash(),
            max_model_len=self.core.max_model_len,
            vocab_size=arch.vocab_size,
            eos_token_ids=arch.eos_token_ids,
            block_size=self.layout.block_size,
            kv_transport=self.kv_address.split("://", 1)[0],
            protocol_version=transfer_pb2.PROTOCOL_VERSION_CURRENT,
            max_num_seqs=self.core.config.scheduler.max_num_seqs,
        )
