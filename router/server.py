"""RouterServer: the router's grpc.aio server (Generation + grpc.health.v1 + reflection).

```
start():  bind (health NOT_SERVING) -> serve -> NodeRegistry.start(source) (until node_wait_s)
          health SERVING while at least one decode node is ready
stop():   health NOT_SERVING, in-flight requests get grace_s, node channels closed
```
"""

from __future__ import annotations

import logging

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pdserve.v1 import generation_pb2, generation_pb2_grpc
from router.config import RouterConfig
from router.dispatcher import Dispatcher
from router.node_registry import NodeRegistry
from router.node_source import NodeSource, StaticNodeSource
from router.policy import make_policy
from router.servicer import GenerationServicer
from router.stats import RouterStats

logger = logging.getLogger(__name__)

GENERATION_SERVICE = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


class RouterServer:
    """One router: construct inside the event loop it will serve on."""

    def __init__(self, config: RouterConfig, source: NodeSource | None = None) -> None:
        self.config = config
        self.stats = RouterStats()
        self.registry = NodeRegistry(config, on_change=self._update_health)
        self._source = source or StaticNodeSource(config.prefill_addrs, config.decode_addrs)
        self._health = health.aio.HealthServicer()
        self._server = grpc.aio.server()
        dispatcher = Dispatcher(self.registry, make_policy(config.policy), config, self.stats)
        generation_pb2_grpc.add_GenerationServicer_to_server(
            GenerationServicer(self.registry, dispatcher, self.stats), self._server
        )
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        reflection.enable_server_reflection(
            (GENERATION_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), self._server
        )
        self.port: int | None = None

    @property
    def address(self) -> str:
        host = f"[{self.config.host}]" if ":" in self.config.host else self.config.host
        return f"{host}:{self.port if self.port is not None else self.config.port}"

    async def start(self) -> int:
        """Serves, then connects to the nodes (returns once each is ready, refused or given up
        on); returns the bound port. Raises OSError when the address cannot be bound."""
        await self._update_health()
        try:
            self.port = self._server.add_insecure_port(self.address)
        except RuntimeError as error:  # grpc raises RuntimeError("Failed to bind ...")
            raise OSError(f"cannot listen on {self.address}: {error}") from None
        await self._server.start()
        logger.info("serving on %s; connecting to nodes", self.address)
        await self.registry.start(self._source)
        return self.port

    async def wait_for_termination(self) -> None:
        await self._server.wait_for_termination()

    async def stop(self, grace_s: float | None = None) -> None:
        """Stops accepting requests; in-flight ones get `grace_s` (default: config.grace_s)."""
        await self._health.enter_graceful_shutdown()
        await self._server.stop(self.config.grace_s if grace_s is None else grace_s)
        await self.registry.close()

    async def _update_health(self) -> None:
        serving = bool(self.registry.decode_nodes)
        status = health_pb2.HealthCheckResponse.SERVING
        if not serving:
            status = health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", GENERATION_SERVICE):
            await self._health.set(service, status)
