"""Dispatcher: routes one request and yields its tokens, retrying an unreachable node once.

```
Dispatcher.run(request)
  RoutingPolicy.pick(request, ready P nodes, ready D nodes) -> Route   no ready D: UNAVAILABLE
  RequestCalls(route).stream()  ──► NodeTokens ...
    NodeUnreachableError (D was UNAVAILABLE before any token reached the client)
      ──► D marked unreachable; pick again without D; run once more (num_retries)
  RequestCalls.close() after every attempt
retry_prefill (called by RequestCalls when P is unreachable before its first token)
  ──► P marked unreachable; the policy's pick among the other prefill nodes, or None
```

Counters: `requests_routed` per node address (every attempt), `local_prefill_routes` by
reason, `num_retries`.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc

from pdserve.config import RouterConfig
from router.errors import NodeUnreachableError, RouterError
from router.input_processor import ProcessedRequest
from router.node_client import NodeClient
from router.node_registry import NodeRegistry
from router.output_processor import NodeTokens
from router.policies import Route, RoutingPolicy
from router.request_calls import RequestCalls
from router.stats import RouterStats

logger = logging.getLogger(__name__)


class Dispatcher:
    """Picks a route among the registry's ready nodes and drives the request's node calls."""

    def __init__(
        self,
        registry: NodeRegistry,
        policy: RoutingPolicy,
        config: RouterConfig,
        stats: RouterStats,
    ) -> None:
        self._registry = registry
        self._policy = policy
        self._config = config
        self._stats = stats

    async def run(
        self, request: ProcessedRequest, timeout_s: float | None = None
    ) -> AsyncIterator[NodeTokens]:
        """Yields the request's tokens from both streams, ending after one with a finish_reason.
        `timeout_s` (the client's deadline) bounds the node calls. Use it inside
        `contextlib.aclosing` so that stopping early aborts the request on its nodes at once."""
        route = self._route(request)
        if route is None:
            raise RouterError(
                grpc.StatusCode.UNAVAILABLE,
                "no decode node is ready: start one (pd-decode) and give its address to the "
                "router with --decode, or register it in the router's --registry",
            )
        for attempt in range(2):  # the route, and once more without an unreachable D
            calls = RequestCalls(
                route,
                request,
                self._config,
                self._stats,
                timeout_s,
                lambda failed: self._retry_prefill(request, failed),
            )
            try:
                async for tokens in calls.stream():
                    yield tokens
                return
            except NodeUnreachableError as error:
                self._registry.mark_unreachable(route.decode)
                retry = self._route(request, exclude=route.decode) if attempt == 0 else None
                if retry is None:
                    raise
                logger.warning(
                    "request %s: %s; retrying on decode node %s",
                    request.request_id, error.message, retry.decode.address,
                )  # fmt: skip
                self._stats.num_retries += 1
                route = retry
            finally:
                await calls.close()

    def _route(self, request: ProcessedRequest, exclude: NodeClient | None = None) -> Route | None:
        """The policy's route among the ready nodes (less `exclude`), counted; None when no
        decode node is left."""
        decode_nodes = [n for n in self._registry.decode_nodes if n is not exclude]
        if not decode_nodes:
            return None
        route = self._policy.pick(request, self._registry.prefill_nodes, decode_nodes)
        self._stats.requests_routed[route.decode.address] += 1
        if route.prefill is not None:
            self._stats.requests_routed[route.prefill.address] += 1
        else:
            self._stats.local_prefill_routes[route.local_reason] += 1
        return route

    def _retry_prefill(self, request: ProcessedRequest, failed: NodeClient) -> NodeClient | None:
        """Another prefill node for a request whose prefill node `failed` was unreachable."""
        self._registry.mark_unreachable(failed)
        others = [n for n in self._registry.prefill_nodes if n is not failed]
        if not others:
            return None
        node = self._policy.pick_prefill(request, others)
        self._stats.num_retries += 1
        self._stats.requests_routed[node.address] += 1
        return node
