"""Dispatcher: routes one request and yields its tokens; retries an unreachable node once and
migrates a request whose decode node dies mid-stream.

```
Dispatcher.run(request)
  RoutingPolicy.pick(request, ready P nodes, ready D nodes) -> Route   no ready D: UNAVAILABLE
  RequestCalls(route).stream()  ──► NodeTokens ...
    NodeUnreachableError (D was UNAVAILABLE before any token reached the client)
      ──► D marked unreachable; pick again without D; run once more (num_retries)
    DecodeLostError (D failed UNAVAILABLE after some tokens reached the client)
      ──► D marked unreachable; pick another D (never one that failed this request); run
          LOCAL_PREFILL with prompt + the tokens streamed so far (num_migrations): D continues
          at the next output index, the client's stream has no gap and no duplicate
      no decode node left ──► UNAVAILABLE
  RequestCalls.close() after every attempt
retry_prefill (called by RequestCalls when P is unreachable before its first token)
  ──► P marked unreachable; the policy's pick among the other prefill nodes, or None
```

Counters: `requests_routed` per node address (every attempt), `local_prefill_routes` by
reason, `num_retries`, `num_migrations`.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, Sequence

import grpc

from pdserve.config import RouterConfig
from router.errors import DecodeLostError, NodeUnreachableError, RouterError
from router.input_processor import ProcessedRequest
from router.node_client import NodeClient
from router.node_registry import NodeRegistry
from router.output_processor import NodeTokens
from router.policies import Route, RoutingPolicy
from router.request_calls import RequestCalls
from router.request_record import RequestRecord, mark
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
    ) -> AsyncGenerator[NodeTokens, None]:
        """Yields the request's tokens from both streams, ending after one with a finish_reason.
        `timeout_s` (the client's deadline) bounds the node calls. Use it inside
        `contextlib.aclosing` so that stopping early aborts the request on its nodes at once.
        `record` (if given) gets the route taken (the last attempt's)."""
        info = self._registry.model_info
        if info is not None:
            await self._policy.prepare(request, max(info.block_size, 1))
        route = self._route(request, record=record)
        if route is None:
            raise RouterError(
                grpc.StatusCode.UNAVAILABLE,
                "no decode node is ready: start one (pd-decode) and give its address to the "
                "router with --decode, or register it in the router's --registry",
            )
        output_token_ids: list[int] = []  # streamed so far (what a migration resumes after)
        lost: list[NodeClient] = []  # decode nodes that failed this request
        while True:
            calls = RequestCalls(
                route,
                request,
                self._config,
                self._stats,
                timeout_s,
                lambda failed: self._retry_prefill(request, failed),
                output_token_ids,
                record.marks if record is not None else None,
            )
            try:
                async for tokens in calls.stream():
                    _extend(output_token_ids, tokens)
                    yield tokens
                return
            except (NodeUnreachableError, DecodeLostError) as error:
                lost.append(route.decode)
                route = self._reroute(request, route, lost, error, output_token_ids, record)
            finally:
                await calls.close()

    def _reroute(
        self,
        request: ProcessedRequest,
        route: Route,
        lost: list[NodeClient],
        error: RouterError,
        output_token_ids: list[int],
        record: RequestRecord | None,
    ) -> Route:
        """The route to run the request on after `route.decode` failed: a retry (nothing
        streamed yet, once) or a migration (with the tokens streamed so far); raises `error`
        when no decode node is left (or a plain retry was already spent)."""
        self._registry.mark_unreachable(route.decode)
        migrating = bool(output_token_ids)
        retry = None
        if migrating or len(lost) == 1:
            retry = self._route(request, exclude=lost, record=record)
        if retry is None:
            if migrating:
                raise RouterError(
                    grpc.StatusCode.UNAVAILABLE,
                    f"{error.detail}; no other decode node is left to continue the request "
                    f"after its {len(output_token_ids)} tokens",
                ) from None
            raise error
        if migrating:
            self._stats.migration()
            logger.warning(
                "request %s: %s; migrating it after %d tokens to decode node %s",
                request.request_id, error.detail, len(output_token_ids), retry.decode.address,
            )  # fmt: skip
        else:
            self._stats.retry()
            logger.warning(
                "request %s: %s; retrying on decode node %s",
                request.request_id, error.detail, retry.decode.address,
            )  # fmt: skip
        return retry

    def _route(
        self,
        request: ProcessedRequest,
        exclude: Sequence[NodeClient] = (),
        record: RequestRecord | None = None,
    ) -> Route | None:
        """The policy's route among the ready nodes (less `exclude`), counted; None when no
        decode node is left."""
        decode_nodes = [n for n in self._registry.decode_nodes if n not in exclude]
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
            mark(record.marks, "routed")
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


def _extend(output_token_ids: list[int], tokens: NodeTokens) -> None:
    """Appends the tokens of `tokens` past the end of `output_token_ids` (streams overlap)."""
    start = len(output_token_ids) - tokens.output_index
    if start >= 0:
        output_token_ids.extend(tokens.token_ids[start:])


def _describe_route(route: Route) -> str:
    """For the access log: "P=ADDR D=ADDR" or "local(REASON) D=ADDR"."""
    if route.prefill is not None:
        return f"P={route.prefill.address} D={route.decode.address}"
    return f"local({route.local_reason}) D={route.decode.address}"
