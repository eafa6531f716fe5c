"""`GrpcNodeServer`: one node's grpc.aio server (both roles), and the `Node` service on it.

```
GrpcNodeServer.start():  bind HOST:PORT (0: a free port; mutual TLS when configured) -> serve
                         `Node` + the role's service + grpc.health.v1 + reflection behind a
                         RequestGuard (a cluster proof on every call but health and
                         reflection, when there is a secret; malformed requests
                         INVALID_ARGUMENT) -> health SERVING
                         -> with a registry: NodeRegistrar.start (record + heartbeat)
GrpcNodeServer.stop():   deregister first (routers stop sending), then health NOT_SERVING,
                         stop accepting; in-flight calls get grace_s, then are cancelled (each
                         role's handlers free what their request holds)

the `Node` service (NodeService), over the node's NodeBackend:
    GetNodeInfo  ──► backend.node_info               (fixed for the node's life)
    GetStats     ──► await backend.stats()
    GetTokenizer ──► backend.tokenizer_files
    Abort        ──► await backend.abort(request_id)
    WatchKVEvents ──► backend.watch_kv_events()     (a stream: snapshot, then changes)
```

Torch- and engine-free: the node (`NodeBase`) is the backend; tests serve fakes.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from node_common.node_registrar import NodeRegistrar
from pdserve.config import RegistryConfig, SecurityConfig
from pdserve.grpc_security import SERVER_OPTIONS, RequestGuard, bind, cluster_check
from pdserve.net import dial_host, host_port
from pdserve.registry import NodeRecord, node_record, sign_record
from pdserve.security import ClusterAuth
from pdserve.v1 import node_pb2, node_pb2_grpc

logger = logging.getLogger(__name__)

NODE_SERVICE = node_pb2.DESCRIPTOR.services_by_name["Node"].full_name
AddServicer = Callable[[Any, grpc.aio.Server], None]  # node_pb2_grpc.add_*Servicer_to_server


class NodeBackend(Protocol):
    """What a node hands the `Node` service (and its registry record)."""

    @property
    def node_info(self) -> node_pb2.NodeInfo: ...

    @property
    def tokenizer_files(self) -> node_pb2.TokenizerFiles: ...

    @property
    def kv_address(self) -> str:
        """Where peers reach this node's KV transport (for the registry record)."""
        ...

    async def stats(self, fresh: bool = True) -> node_pb2.NodeStats:
        """`fresh=False`: without waiting for the engine (its last step's figures)."""
        ...

    async def abort(self, request_id: str) -> bool:
        """End the request wherever it is on this node; False when the node holds no such
        request."""
        ...

    def watch_kv_events(self) -> AsyncIterator[node_pb2.KVEvents]:
        """The prefix cache's block hashes: a snapshot, then the changes (KVEventHub)."""
        ...


class NodeService(node_pb2_grpc.NodeServicer):
    """The `Node` service every node serves, answered by its backend."""

    def __init__(self, backend: NodeBackend) -> None:
        self._backend = backend

    async def GetNodeInfo(
        self, request: node_pb2.GetNodeInfoRequest, context: grpc.aio.ServicerContext
    ) -> node_pb2.NodeInfo:
        return self._backend.node_info

    async def GetStats(
        self, request: node_pb2.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> node_pb2.NodeStats:
        return await self._backend.stats()

    async def GetTokenizer(
        self, request: node_pb2.GetTokenizerRequest, context: grpc.aio.ServicerContext
    ) -> node_pb2.TokenizerFiles:
        return self._backend.tokenizer_files

    async def Abort(
        self, request: node_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> node_pb2.AbortResponse:
        if not request.request_id:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "Abort needs the request_id to end"
            )
        return node_pb2.AbortResponse(found=await self._backend.abort(request.request_id))

    async def WatchKVEvents(
        self, request: node_pb2.WatchKVEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[node_pb2.KVEvents]:
        async for message in self._backend.watch_kv_events():
            yield message


class GrpcNodeServer:
    """`Node` + one role service + health + reflection on one grpc.aio server. Construct it
    inside the event loop it serves on."""

    def __init__(
        self,
        host: str,
        port: int,
        backend: NodeBackend,
        role_service: str,
        add_role_servicer: Callable[[grpc.aio.Server], None],
        registry: RegistryConfig | None = None,
        advertise_host: str | None = None,
        security: SecurityConfig | None = None,
        auth: ClusterAuth | None = None,
    ) -> None:
        """`role_service`: the full name of the role's service (e.g. "pdserve.v1.PrefillNode");
        `add_role_servicer(server)` registers its servicer. With `registry`, the node registers
        itself once serving, under `advertise_host` (default: `host`, or this machine's
        address when `host` is a wildcard). With `auth`, every call but health and reflection
        must carry a cluster proof made for this node (`names`; UNAUTHENTICATED otherwise: a
        proof made for another node too), and the registry record is
        signed; `security` says whether to serve mutual TLS."""
        self._host = host
        self._backend = backend
        self._advertise_host = advertise_host
        self.node_id = uuid.uuid4().hex
        self.registrar = (
            NodeRegistrar(registry, self.node_id, self._record) if registry is not None else None
        )
        self._security = security or SecurityConfig()
        self._auth = auth
        self._services = ("", NODE_SERVICE, role_service)
        self._health = health.aio.HealthServicer()
        guard = RequestGuard(cluster_check(auth, self.names) if auth is not None else None)
        self._server = grpc.aio.server(interceptors=[guard], options=SERVER_OPTIONS)
        add_node_service: AddServicer = node_pb2_grpc.add_NodeServicer_to_server  # generated
        add_node_service(NodeService(backend), self._server)
        add_role_servicer(self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        reflection.enable_server_reflection(
            (NODE_SERVICE, role_service, health.SERVICE_NAME, reflection.SERVICE_NAME),
            self._server,
        )
        self.port = port
        self._started = False

    @property
    def address(self) -> str:
        """HOST:PORT clients dial (the bound port once started)."""
        return host_port(self._host, self.port)

    async def start(self) -> int:
        """Bind and serve; return the bound port. Raises OSError when the address is taken."""
        try:
            self.port = bind(self._server, self.address, self._security)
        except RuntimeError as error:  # grpc raises RuntimeError("Failed to bind ...")
            raise OSError(f"cannot listen on {self.address}: {error}") from None
        await self._server.start()
        self._started = True
        for service in self._services:
            await self._health.set(service, health_pb2.HealthCheckResponse.SERVING)
        if self.registrar is not None:
            await self.registrar.start()
        return self.port

    def names(self) -> set[str]:
        """The HOST:PORTs a call proof for this node may name: as bound, and as advertised
        (its registry record's address)."""
        return {self.address, self.dial_address}

    @property
    def dial_address(self) -> str:
        """HOST:PORT other machines dial (what the registry record holds)."""
        return host_port(self._advertise_host or dial_host(self._host), self.port)

    async def stop(self, grace_s: float) -> None:
        """Deregister, stop accepting calls; in-flight ones get `grace_s`, then are cancelled."""
        if self.registrar is not None and self._started:
            await self.registrar.stop()
        await self._health.enter_graceful_shutdown()
        if self._started:
            await self._server.stop(grace_s)
            self._started = False

    async def _record(self) -> NodeRecord:
        assert self.registrar is not None  # only the registrar asks
        record = node_record(
            self.node_id,
            self.dial_address,
            self._backend.kv_address,
            self._backend.node_info,
            await self._backend.stats(fresh=False),  # never waits for an engine step
            self.registrar.config,
        )
        return sign_record(self._auth, record) if self._auth is not None else record
