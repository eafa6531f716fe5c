"""`NodeServer`: one node's grpc.aio server, and the launchers' main loop (both roles).

```
NodeServer.start():  bind HOST:PORT (0: a free port) -> serve `Node` + the role's service
                     + grpc.health.v1 + reflection -> health SERVING
                     -> with a registry: NodeRegistrar.start (record + heartbeat)
NodeServer.stop():   deregister first (routers stop sending), then health NOT_SERVING, stop
                     accepting; in-flight calls get grace_s, then are cancelled (each role's
                     handlers free what their request holds)

serve_until_signalled(start_node, "pd-prefill"):
    start_node() ──► print "pd-prefill listening on HOST:PORT (kv ADDRESS)" (flushed)
    SIGINT / SIGTERM (also while starting) ──► node.stop() ──► return
```

Torch- and engine-free, like `pdserve.node_service`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import sys
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pdserve.node_registrar import NodeRegistrar
from pdserve.node_service import NodeBackend, NodeServicer
from pdserve.registry import NodeRecord, RegistryConfig, node_record
from pdserve.v1 import node_pb2, node_pb2_grpc

logger = logging.getLogger(__name__)

NODE_SERVICE = node_pb2.DESCRIPTOR.services_by_name["Node"].full_name


@dataclass(frozen=True)
class NodeServerConfig:
    """Where a node listens and how it hands KV over (both roles)."""

    host: str = "127.0.0.1"
    port: int = 0  # gRPC port; 0: a free one
    kv_transport: str = "auto"  # "auto" | "ucx" | "tcp" | "local" (cache_transfer.make_transport)
    kv_port: int = 0  # KV transport port; 0: a free one
    # The address peers reach this node's KV transport at (e.g. the pod IP when `host` is
    # 0.0.0.0); None: `host`.
    advertise_host: str | None = None
    # Decode: how long a DISAGGREGATED request waits for its KV when the request gives no
    # timeout. Prefill: how long a sender may take from handshake to the decode node's result.
    transfer_timeout_s: float = 10.0
    grace_s: float = 5.0  # on stop, how long in-flight calls may take before they are cancelled
    registry: RegistryConfig | None = None  # None: no registration (the router lists the node)

    def __post_init__(self) -> None:
        for name in ("port", "kv_port"):
            value = getattr(self, name)
            if not 0 <= value < 65536:
                raise ValueError(f"{name} must be in [0, 65535] (0: a free port), got {value}")
        if not self.transfer_timeout_s > 0:
            raise ValueError(f"transfer_timeout_s must be > 0, got {self.transfer_timeout_s}")
        if not self.grace_s >= 0:
            raise ValueError(f"grace_s must be >= 0, got {self.grace_s}")

    @property
    def kv_host(self) -> str:
        """Where the KV transport listens (and what it advertises)."""
        return self.advertise_host or self.host


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
    ) -> None:
        """`role_service`: the full name of the role's service (e.g. "pdserve.v1.PrefillNode");
        `add_role_servicer(server)` registers its servicer. With `registry`, the node registers
        itself once serving, under `advertise_host` (default: `host`, or this machine's
        address when `host` is a wildcard)."""
        self._host = host
        self._backend = backend
        self._advertise_host = advertise_host
        self.node_id = uuid.uuid4().hex
        self.registrar = (
            NodeRegistrar(registry, self.node_id, self._record) if registry is not None else None
        )
        self._services = ("", NODE_SERVICE, role_service)
        self._health = health.aio.HealthServicer()
        self._server = grpc.aio.server()
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
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"{host}:{self.port}"

    async def start(self) -> int:
        """Bind and serve; return the bound port. Raises OSError when the address is taken."""
        try:
            self.port = self._server.add_insecure_port(self.address)
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
        dial_host = self._advertise_host or _dial_host(self._host)
        host = f"[{dial_host}]" if ":" in dial_host else dial_host
        return f"{host}:{self.port}"

    async def stop(self, grace_s: float) -> None:
        """Deregister, stop accepting calls; in-flight ones get `grace_s`, then are cancelled."""
        if self.registrar is not None and self._started:
            await self.registrar.stop()
        await self._health.enter_graceful_shutdown()
        if self._started:
            await self._server.stop(grace_s)
            self._started = False

    async def _record(self) -> NodeRecord:
        return node_record(
            self.node_id,
            self.dial_address,
            self._backend.kv_address,
            self._backend.node_info,
            await self._backend.stats(),
            self.registrar.config,
        )


def _dial_host(host: str) -> str:
    """`host`, or this machine's address when `host` is a wildcard (0.0.0.0, ::)."""
    if host in ("0.0.0.0", "::", ""):
        return socket.gethostbyname(socket.gethostname())
    return host


class RunningNode(Protocol):
    """What `serve_until_signalled` runs: a prefill or decode server."""

    @property
    def address(self) -> str: ...

    @property
    def kv_address(self) -> str: ...

    async def start(self) -> None: ...

    async def stop(self, grace_s: float | None = None) -> None: ...


async def serve_until_signalled(
    start_node: Callable[[], Awaitable[RunningNode]], name: str
) -> None:
    """Start a node, print "`name` listening on HOST:PORT (kv ADDRESS)" once it serves, and
    stop it gracefully on SIGINT or SIGTERM (also one that arrives while it is starting)."""
    stop_requested = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop_requested.set)
    starting = asyncio.create_task(start_node())
    stopping = asyncio.create_task(stop_requested.wait())
    node: RunningNode | None = None
    try:
        await asyncio.wait((starting, stopping), return_when=asyncio.FIRST_COMPLETED)
        if starting.done():
            node = starting.result()  # raises what start_node() raised
            print(f"{name} listening on {node.address} (kv {node.kv_address})", flush=True)
            await stopping
        logger.info("%s: stopping", name)
    finally:
        stopping.cancel()
        if not starting.done():  # a signal while starting: let it clean up after itself
            starting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await starting
        if node is not None:
            await node.stop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)


def run_node(
    name: str,
    make_core: Callable[[], object],
    make_server: Callable[[object], RunningNode],
) -> int:
    """The launchers' main loop, shared by pd-prefill and pd-decode: build the engine core off
    the event loop (signals stay handled while the model loads), start the role's server, serve
    until SIGINT/SIGTERM. Returns the exit code (1, with a message, when it cannot start)."""

    async def start() -> RunningNode:
        core = await asyncio.to_thread(make_core)
        server = make_server(core)
        try:
            await server.start()
        except BaseException:
            await server.stop(grace_s=0)
            raise
        return server

    try:
        asyncio.run(serve_until_signalled(start, name))
    except (OSError, ValueError) as error:
        print(f"{name}: {error}", file=sys.stderr)
        return 1
    return 0
