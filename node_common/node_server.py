"""`NodeServer`: one node's grpc.aio server (both roles).

```
NodeServer.start():  bind HOST:PORT (0: a free port; mutual TLS when configured) -> serve `Node` + the role's service
                     + grpc.health.v1 + reflection behind a RequestGuard (a cluster proof
                     on every call but health and reflection, when there is a secret;
                     malformed requests INVALID_ARGUMENT) -> health SERVING
                     -> with a registry: NodeRegistrar.start (record + heartbeat)
NodeServer.stop():   deregister first (routers stop sending), then health NOT_SERVING, stop
                     accepting; in-flight calls get grace_s, then are cancelled (each role's
                     handlers free what their request holds)
```

Torch- and engine-free, like `node_common.node_service`.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from node_common.node_registrar import NodeRegistrar
from node_common.node_service import NodeBackend, NodeServicer
from pdserve.config import RegistryConfig, SecurityConfig
from pdserve.grpc_security import SERVER_OPTIONS, RequestGuard, bind, cluster_check
from pdserve.net import dial_host, host_port
from pdserve.registry import NodeRecord, node_record, sign_record
from pdserve.security import ClusterAuth
from pdserve.v1 import node_pb2, node_pb2_grpc

logger = logging.getLogger(__name__)

NODE_SERVICE = node_pb2.DESCRIPTOR.services_by_name["Node"].full_name


class NodeServer:
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
        must carry a cluster proof (UNAUTHENTICATED otherwise), and the registry record is
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
        guard = RequestGuard(cluster_check(auth) if auth is not None else None)
        self._server = grpc.aio.server(interceptors=[guard], options=SERVER_OPTIONS)
        node_pb2_grpc.add_NodeServicer_to_server(NodeServicer(backend), self._server)
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
        record = node_record(
            self.node_id,
            self.dial_address,
            self._backend.kv_address,
            self._backend.node_info,
            await self._backend.stats(fresh=False),  # never waits for an engine step
            self.registrar.config,
        )
        return sign_record(self._auth, record) if self._auth is not None else record
