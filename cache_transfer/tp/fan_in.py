"""`FanIn`: one tensor-parallel hand-off's KV into one decode rank's pool.

```
FanIn(manager, ticket, own rank, caches, layout, blocks, tokens, timeouts)
    manager.accept_routes(transfer_id, accept): the first message of a session named
    "<transfer_id>:<a>.<i>><j>:<start>-<end>" (head_routes.route_id) reaches `accept`, which
    makes its KVReceiver when the route fits: j is this rank, the heads lie in this rank's,
    overlap no route taken so far, come from a prefill node of the same size as the others;
    the receiver writes only into views of this rank's pool over those heads (head_views),
    only into the ticket's blocks, on the route's own ticket (route_tickets.py: its proof)
every route SUCCESS and their heads tile this rank's ──► SUCCESS (rank 0: the route from
    prefill rank 0 brought the first token); any route FAILED ──► every route aborted
    (their senders told); not every route within timeout_s (from the start, or with
    `wait_first` from the first route: a TP 1 decode node's fan-in beside its receiver)
    ──► FAILED; each route then as any receiver (no progress for timeout_s; its sender's
    ceiling, at most max_ceiling_s)
```

The prefill node's plan decides the routes; a decode rank needs no knowledge of the prefill
node's size beyond what each route's name and handshake say (and checks).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from cache_transfer.kv_transfer_manager import KVTransferManager
from cache_transfer.layout import KVCaches, KVLayout
from cache_transfer.protocol import TransferMessage
from cache_transfer.receiver import KVReceiver, LayerCallback
from cache_transfer.route_slice import RouteSlice
from cache_transfer.tp.head_routes import Route, parse_route_id
from cache_transfer.tp.head_slices import head_views
from cache_transfer.tp.route_tickets import DecodeRank, route_ticket
from cache_transfer.tp.session_group import SessionGroup
from pdserve.v1 import node_pb2, transfer_pb2

logger = logging.getLogger(__name__)


class FanIn:
    def __init__(
        self,
        manager: KVTransferManager,
        ticket: node_pb2.TransferTicket,
        own: DecodeRank,
        kv_caches: KVCaches,
        layout: KVLayout,
        timeouts_s: tuple[float, float | None],  # (timeout_s, max_ceiling_s)
        may_accept: Callable[[], bool] = lambda: True,
        on_first_route: Callable[[], None] | None = None,
        log_id: str = "",
    ) -> None:
        """`kv_caches`: this rank's pool (its heads); `layout`: the model's (every kv head);
        `may_accept`: whether a route may still start (False: the hand-off went another way);
        `on_first_route`: called when the first route is taken (the routes' deadline starts
        then; without it, now); `log_id`: the request's id."""
        self.transfer_id = ticket.transfer_id
        self.own = own
        self.receivers: list[tuple[Route, KVReceiver]] = []
        self._manager = manager
        self._ticket = ticket
        self._kv_caches = kv_caches
        self._layout = layout
        self._timeout_s, self._max_ceiling_s = timeouts_s
        self._log_id = log_id
        self._may_accept = may_accept
        self._on_first_route = on_first_route
        self._layer_callbacks: list[LayerCallback] = []
        self._tried: set[str] = set()  # route sessions made (a late message makes none again)
        ceiling_s = self._timeout_s if self._max_ceiling_s is None else self._max_ceiling_s
        self.group = SessionGroup(ticket.transfer_id, self._timeout_s + ceiling_s)
        if on_first_route is None:
            self.group.seal_by(self._timeout_s)
        self.group.add_finish_callback(lambda _: manager.accept_routes(self.transfer_id, None))
        manager.accept_routes(self.transfer_id, self.accept)

    @property
    def first_token(self) -> transfer_pb2.FirstToken | None:
        return next((r.first_token for route, r in self.receivers if route.first_token), None)

    @property
    def num_bytes_received(self) -> int:
        return sum(r.num_bytes_received for _, r in self.receivers)

    def add_layer_callback(self, callback: LayerCallback) -> None:
        """`callback(layer_idx, token_end)` as each route's layer lands (once per route)."""
        self._layer_callbacks.append(callback)
        for _, receiver in self.receivers:
            receiver.add_layer_callback(callback)

    def accept(self, peer_id: str, msg: TransferMessage) -> KVReceiver | None:
        """The receiver of a route's first message (the manager's RouteAcceptor), or None:
        not a route of this hand-off that fits (logged; the message is refused)."""
        parsed = parse_route_id(msg.transfer_id)
        why = "not a route name" if parsed is None else self._misfit(parsed[1])
        if msg.transfer_id in self._tried:
            why = "a route that ran already"
        if why is not None or parsed is None:
            logger.warning("transfer %s: refused route %r from %s: %s", self.transfer_id,
                           msg.transfer_id, peer_id, why)  # fmt: skip
            return None
        self._tried.add(msg.transfer_id)
        if not self.receivers and self._on_first_route is not None:
            self._on_first_route()
            self.group.seal_by(self._timeout_s)
        receiver = self._receiver(msg.transfer_id, parsed[1])
        self.receivers.append((parsed[1], receiver))
        for callback in self._layer_callbacks:
            receiver.add_layer_callback(callback)
        self.group.add(receiver)
        if self._tiled():
            self.group.seal()
        return receiver

    def _misfit(self, route: Route) -> str | None:
        heads = self.own.heads
        if self.group.finished or not self._may_accept():
            return "the hand-off ended or went another way"
        if route.dst_rank != heads.rank:
            return f"it is for decode rank {route.dst_rank}, this is rank {heads.rank}"
        if not heads.kv_head_start <= route.kv_head_start < route.kv_head_end <= heads.kv_head_end:
            return (
                f"kv heads [{route.kv_head_start}, {route.kv_head_end}) are not among this "
                f"rank's [{heads.kv_head_start}, {heads.kv_head_end})"
            )
        for taken, _ in self.receivers:
            if taken.src_tp_size != route.src_tp_size:
                return f"prefill TP {route.src_tp_size}, another route's is {taken.src_tp_size}"
            if taken.kv_head_start < route.kv_head_end and route.kv_head_start < taken.kv_head_end:
                return f"its heads overlap route {taken}"
        return None

    def _receiver(self, session_id: str, route: Route) -> KVReceiver:
        start = self.own.heads.kv_head_start
        layout = self._layout.with_heads(route.num_kv_heads)
        views = head_views(self._kv_caches, route.kv_head_start - start, route.kv_head_end - start)
        ticket = route_ticket(self._manager.auth, self._ticket, route, self.own, layout)
        slice_ = RouteSlice(layout, route.heads, route.first_token, views, ticket)
        return self._manager.create_receiver(
            self._ticket.dst_block_ids, self._ticket.num_tokens, self._timeout_s,
            transfer_id=session_id, max_ceiling_s=self._max_ceiling_s, log_id=self._log_id,
            route=slice_,
        )  # fmt: skip

    def _tiled(self) -> bool:
        """The routes taken cover every head of this rank (disjoint: checked as they come)."""
        heads = self.own.heads
        covered = sum(route.num_kv_heads for route, _ in self.receivers)
        return covered == heads.kv_head_end - heads.kv_head_start
