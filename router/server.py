"""RouterServer: the router's grpc.aio server (Generation + grpc.health.v1 + reflection).

```
start():  bind (health NOT_SERVING) -> serve -> NodeRegistry.start(static source) (until
          node_wait_s) -> with a registry: admit its nodes (until node_wait_s), then follow it
          in the background; health SERVING while at least one decode node is ready and its
          connection alive (re-checked every HEALTH_CHECK_INTERVAL_S)
          + the HTTP server (OpenAI API, /health, /metrics) on http_port unless 0
stop():   stop following the registry, health NOT_SERVING, HTTP and gRPC in-flight requests
          get grace_s, node channels closed
```
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pdserve.config import RouterConfig
from pdserve.grpc_security import SERVER_OPTIONS, RequestGuard
from pdserve.net import host_port
from pdserve.security import load_cluster_auth, open_cluster_warning
from pdserve.v1 import generation_pb2, generation_pb2_grpc
from router.auth import ApiKeys, install
from router.dispatcher import Dispatcher
from router.node_registry import NodeRegistry
from router.node_source import NodeSource, StaticNodeSource
from router.policies import make_policy
from router.redis_node_source import RedisNodeSource
from router.request_handler import RequestHandler
from router.servicer import GenerationServicer
from router.stats import RouterStats
from router.tenancy import CacheSalts

if TYPE_CHECKING:
    from router.http.http_server import HttpServer

logger = logging.getLogger(__name__)

GENERATION_SERVICE = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
HEALTH_CHECK_INTERVAL_S = 1.0  # how often health re-checks the decode nodes' connections


class RouterServer:
    """One router: construct inside the event loop it will serve on."""

    def __init__(self, config: RouterConfig, source: NodeSource | None = None) -> None:
        self.config = config
        self.stats = RouterStats()
        self.auth = load_cluster_auth(config.security)
        if self.auth is None:
            logger.warning(open_cluster_warning("router"))
        self.registry = NodeRegistry(config, on_change=self._update_health, auth=self.auth)
        self._source = source or StaticNodeSource(config.prefill_addrs, config.decode_addrs)
        self.registry_source = (
            RedisNodeSource(config.registry, self.auth) if config.registry else None
        )
        self._watch_task: asyncio.Task[None] | None = None
        self._health_task: asyncio.Task[None] | None = None
        self._health = health.aio.HealthServicer()
        self._health_status: int | None = None  # last set; None: not yet
        self.api_keys = ApiKeys.from_file(config.api_key_file) if config.api_key_file else None
        install(self.api_keys)
        check = self.api_keys.grpc_check if self.api_keys is not None else None
        self._server = grpc.aio.server(interceptors=[RequestGuard(check)], options=SERVER_OPTIONS)
        self.policy = make_policy(
            config.policy, config.local_prefill_max_tokens, config.prefill_saturation_tokens,
            config.prefix_cache_salt,
        )  # fmt: skip
        dispatcher = Dispatcher(self.registry, self.policy, config, self.stats)
        salts = CacheSalts(self.auth, config.prefix_cache_salt,
                           not config.share_prefix_cache_across_tenants, self.api_keys is not None)  # fmt: skip
        self.handler = RequestHandler(
            self.registry, dispatcher, self.stats, config.max_prompt_chars, salts
        )
        generation_pb2_grpc.add_GenerationServicer_to_server(
            GenerationServicer(self.handler), self._server
        )
        self.http: HttpServer | None = None
        if config.http_port:
            # Imported here: a router run with --http-port 0 needs no FastAPI stack installed.
            from router.http.http_server import router_http_server

            self.http = router_http_server(
                config, self.handler, self.stats.metrics, self.registry.serving, self.api_keys
            )
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        reflection.enable_server_reflection(
            (GENERATION_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), self._server
        )
        self.port: int | None = None

    @property
    def address(self) -> str:
        return host_port(self.config.host, self.port if self.port is not None else self.config.port)

    async def start(self) -> int:
        """Serves, then connects to the nodes (returns once each is ready, refused or given up
        on); returns the bound port. Raises OSError when the address cannot be bound."""
        await self._update_health()
        try:
            self.port = self._server.add_insecure_port(self.address)
        except RuntimeError as error:  # grpc raises RuntimeError("Failed to bind ...")
            raise OSError(f"cannot listen on {self.address}: {error}") from None
        await self._server.start()
        if self.http is not None:
            await self.http.start()
            logger.info("OpenAI-compatible HTTP API on %s/v1", self.http.url)
        logger.info("serving on %s; connecting to nodes", self.address)
        await self.registry.start(self._source)
        if self.registry_source is not None:
            await self._follow_registry(self.registry_source)
        self._health_task = asyncio.create_task(self._watch_health(), name="health")
        self._health_task.add_done_callback(_log_failure)
        return self.port

    async def wait_for_termination(self) -> None:
        await self._server.wait_for_termination()

    async def stop(self, grace_s: float | None = None) -> None:
        """Stops accepting requests; in-flight ones get `grace_s` (default: config.grace_s)."""
        for task in (self._watch_task, self._health_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self._health.enter_graceful_shutdown()
        if self.http is not None:
            await self.http.stop()
        await self._server.stop(self.config.grace_s if grace_s is None else grace_s)
        await self.policy.close()
        await self.registry.close()
        if self.registry_source is not None:
            await self.registry_source.close()

    async def _follow_registry(self, source: RedisNodeSource) -> None:
        """Admits the nodes registered now (each until node_wait_s), then follows the
        registry in the background. Redis being away is logged, not raised."""
        joining = await self.registry.sync(await source.list_nodes())
        await asyncio.gather(*joining, return_exceptions=True)
        logger.info(
            "registry %s: %d prefill and %d decode nodes ready",
            source.config.redacted_url,
            len(self.registry.prefill_nodes),
            len(self.registry.decode_nodes),
        )
        self._watch_task = asyncio.create_task(self.registry.watch(source), name="registry")
        self._watch_task.add_done_callback(_log_failure)

    async def _update_health(self) -> None:
        self.policy.follow(self.registry.ready_nodes)  # (the kv_events policy's streams)
        status = health_pb2.HealthCheckResponse.SERVING
        if not self.registry.serving():
            status = health_pb2.HealthCheckResponse.NOT_SERVING
        if status != self._health_status:
            self._health_status = status
            for service in ("", GENERATION_SERVICE):
                await self._health.set(service, status)

    async def _watch_health(self) -> None:
        """Re-checks the decode nodes' connections every HEALTH_CHECK_INTERVAL_S: health
        follows a node that died (or came back) without waiting for a request to find out."""
        while True:
            await asyncio.sleep(HEALTH_CHECK_INTERVAL_S)
            await self._update_health()


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("following the registry failed", exc_info=task.exception())
