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
from router.request_record import RequestRecord
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
        self,
        request: ProcessedRequest,
        timeout_s: float | None = None,
        record: RequestRecord | None = None,
    ) -> AsyncIterator[NodeTokens]:
        """Yields the request's tokens from both streams, ending after one with a finish_reason.
        `timeout_s` (the client's deadline) bounds the node calls. Use it inside
        `contextlib.aclosing` so that stopping early aborts the request on its nodes at once.
        `record` (if given) gets the route taken (the last attempt's)."""
        route = self._route(request, record=record)
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
                retry = None
                if attempt == 0:
                    retry = self._route(request, exclude=route.decode, record=record)
                if retry is None:
                    raise
                logger.warning(
                    "request %s: %s; retrying on decode node %s",
                    request.request_id, error.message, retry.decode.address,
                )  # fmt: skip
                self._stats.retry()
                route = retry
            finally:
                await calls.close()

    def _route(
        self,
        request: ProcessedRequest,
        exclude: NodeClient | None = None,
        record: RequestRecord | None = None,
    ) -> Route | None:
        """The policy's route among the ready nodes (less `exclude`), counted; None when no
        decode node is left."""
        decode_nodes = [n for n in self._registry.decode_nodes if n is not exclude]
        if not decode_nodes:
            return None
        route = self._policy.pick(request, self._registry.prefill_nodes, decode_nodes)
        self._stats.routed(route.decode.address)
        if route.prefill is not None:
            self._stats.routed(route.prefill.address)
            self._stats.route_picked(None)
        else:
            self._stats.route_picked(route.local_reason)
        if record is not None:
            record.route = _describe_route(route)
        return route

    def _retry_prefill(self, request: ProcessedRequest, failed: NodeClient) -> NodeClient | None:
        """Another prefill node for a request whose prefill node `failed` was unreachable."""
        self._registry.mark_unreachable(failed)
        others = [n for n in self._registry.prefill_nodes if n is not failed]
        if not others:
            return None
        node = self._policy.pick_prefill(request, others)
        self._stats.retry()
        self._stats.routed(node.address)
        return node


def _describe_route(route: Route) -> str:
    """For the access log: "P=ADDR D=ADDR" or "local(REASON) D=ADDR"."""
    if route.prefill is not None:
        return f"P={route.prefill.address} D={route.decode.address}"
    return f"local({route.local_reason}) D={route.decode.address}"
