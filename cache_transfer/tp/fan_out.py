"""`FanOutSender`: one request's KV hand-off from one prefill rank of a tensor-parallel node,
driven as one sender (the prefill node's `LayerStreamer` drives it as it drives a `KVSender`).

```
FanOutSender.create(manager, ticket, layout, own rank, prefill ranks, timeout_s, ceiling_s)
    with a cluster secret: the ticket's signature (nobody contacted otherwise); its layout;
    plan_routes(prefill ranks, the ticket's decode ranks) ─► the routes leaving this rank
    (ValueError naming both sizes: a plan that cannot be made); per route a KVSender on its
    own ticket (route_tickets.py) over the route's head slice, never written in place; each
    handshakes at once, fails after timeout_s without progress or at ceiling_s
beat(n)                       every route may tell its receiver this node progresses
start()                       the prefill started (marks elapsed_s)
send_packed_layers(layers)    each route sends the layers as packed (all of this rank's heads)
                              or its head slice of them (slice_packed)
send_first_token(...)         on the route to decode rank 0 (rank 0 only), once that route's
                              layer sends completed; the other routes end with their layers
whole.add_remote(part), whole.seal()
                              rank 0: the other ranks' shares (their reports), so `state`,
                              `wait()` and the result are the whole hand-off's (WholeHandOff)
abort() / cancel()            every route (cancel: nobody needs it, DEBUG) and every share
```

Any route failing fails the others (their receivers told); the node tells the other ranks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import torch

from cache_transfer.kv_transfer_manager import KVTransferManager
from cache_transfer.layout import KVLayout
from cache_transfer.route_slice import RouteSlice
from cache_transfer.sender import KVSender
from cache_transfer.state import TransferState
from cache_transfer.tickets import check_ticket, ticket_misfit, ticket_suffix
from cache_transfer.tp.head_routes import RankHeads, Route, plan_routes
from cache_transfer.tp.head_slices import slice_packed
from cache_transfer.tp.route_tickets import decode_ranks, route_ticket
from cache_transfer.tp.whole_hand_off import WholeHandOff
from pdserve.v1 import generation_pb2, node_pb2

GROUP_MARGIN_S = 5.0  # the group's own deadline lies past every route's by this


class TicketRefused(ValueError):
    """The ticket does not verify (forged, expired) or does not fit this node: nobody is
    contacted."""


class FanOutSender:
    def __init__(
        self,
        ticket: node_pb2.TransferTicket,
        routes: list[tuple[Route, KVSender]],
        own: RankHeads,
        layout: KVLayout,
        group_timeout_s: float,
        log_id: str = "",
    ) -> None:
        """Use `create`. `layout`: the model's (every kv head)."""
        self.transfer_id = ticket.transfer_id
        self.log_id = log_id
        self.routes = routes
        self.num_tokens = ticket.num_tokens
        self.suffix = ticket_suffix(layout, ticket)  # every route skips what D holds (KVSuffix)
        self.num_blocks = self.suffix.num_blocks
        self.num_bytes_skipped = layout.kv_bytes(self.suffix.num_cached_blocks)
        self.whole = WholeHandOff(self, ticket.transfer_id, group_timeout_s)  # + other ranks'
        self.group = self.whole.group  # this rank's routes
        self.plan: list[Route] = [route for route, _ in routes]  # every rank's (create)
        self._own = own
        self._rank_layout = layout.with_heads(own.kv_head_end - own.kv_head_start)
        self._first_route_sends: set[asyncio.Task[None]] = set()
        for _, sender in routes:
            self.group.add(sender)

    @classmethod
    def create(
        cls,
        manager: KVTransferManager,
        ticket: node_pb2.TransferTicket,
        layout: KVLayout,
        own: RankHeads,
        prefill_ranks: Sequence[RankHeads],
        timeout_s: float,
        ceiling_s: float | None = None,
        log_id: str = "",
    ) -> FanOutSender:
        """This rank's routes of the hand-off `ticket` asks for, each a KVSender with
        `timeout_s`, `ceiling_s`, `log_id`. TicketRefused when the ticket does not verify or
        fit, or no plan matches the two nodes' ranks."""
        auth = manager.auth
        forged = check_ticket(auth, ticket) if auth is not None else None
        misfit = forged or ticket_misfit(layout, ticket)
        if misfit is not None:
            raise TicketRefused(f"refused the ticket: {misfit}")
        try:
            dst = decode_ranks(ticket, layout.num_kv_heads)
            routes = plan_routes(prefill_ranks, [d.heads for d in dst], layout.num_kv_heads)
        except ValueError as error:
            raise TicketRefused(str(error)) from None
        senders = []
        for route in (r for r in routes if r.src_rank == own.rank):
            route_layout = layout.with_heads(route.num_kv_heads)
            route_t = route_ticket(auth, ticket, route, dst[route.dst_rank], route_layout)
            slice_ = RouteSlice(route_layout, route.heads, route.first_token)
            sender = manager.create_sender(route_t, timeout_s, ceiling_s, log_id, route=slice_)
            senders.append((route, sender))
        group_timeout_s = (timeout_s if ceiling_s is None else ceiling_s) + GROUP_MARGIN_S
        fan_out = cls(ticket, senders, own, layout, group_timeout_s, log_id)
        fan_out.plan = routes
        if own.rank != 0:
            fan_out.whole.seal()  # rank 0 seals once the other ranks' shares joined
        return fan_out

    # ---- what LayerStreamer and the prefill servicer use of a sender (the whole's) --------

    @property
    def state(self) -> TransferState:
        return self.whole.state

    @property
    def error(self) -> str | None:
        return self.whole.error

    @property
    def finished(self) -> bool:
        return self.whole.finished

    @property
    def remaining_s(self) -> float:
        return min((s.remaining_s for _, s in self.routes), default=0.0)

    @property
    def elapsed_s(self) -> float:
        return self.whole.elapsed_s

    @property
    def num_bytes_sent(self) -> int:
        return sum(s.num_bytes_sent for _, s in self.routes) + self.whole.remote_bytes

    @property
    def dst_kv_device(self) -> str:
        return ""  # a TP hand-off is never held back for a receiver on our GPU

    @property
    def in_place_writer(self) -> None:
        return None  # nor written in place

    def start(self) -> None:
        for _, sender in self.routes:
            sender.start()

    def beat(self, num_computed_tokens: int) -> None:
        for _, sender in self.routes:
            sender.beat(num_computed_tokens)

    def abort(self, reason: str) -> None:
        self.whole.abort(reason)

    def cancel(self, reason: str) -> None:
        self.whole.cancel(reason)

    def add_finish_callback(self, callback: Callable[[FanOutSender], None]) -> None:
        self.whole.add_finish_callback(callback)

    async def wait(self) -> TransferState:
        return await self.whole.wait()

    async def send_packed_layers(
        self, layers: Sequence[tuple[int, torch.Tensor]], token_end: int | None = None
    ) -> None:
        """Each route sends `layers` (this rank's heads, packed), or its slice of them."""
        sends = []
        for route, sender in self.routes:
            start = route.kv_head_start - self._own.kv_head_start
            end = route.kv_head_end - self._own.kv_head_start
            payloads = layers
            if (start, end) != (0, self._rank_layout.num_kv_heads):
                payloads = [(i, self._slice(p, start, end)) for i, p in layers]
            send = asyncio.ensure_future(sender.send_packed_layers(payloads, token_end))
            if route.first_token:
                self._first_route_sends.add(send)
                send.add_done_callback(self._first_route_sends.discard)
            sends.append(send)
        await asyncio.gather(*sends)

    async def send_written_layers(
        self, layer_ids: Sequence[int], token_end: int | None = None
    ) -> None:
        raise ValueError(f"transfer {self.transfer_id}: a TP hand-off is never written in place")

    async def send_first_token(
        self,
        token_id: int,
        logprob: generation_pb2.TokenLogprob | None = None,
        finish_reason: str = "",
        draft_token_ids: Sequence[int] = (),
    ) -> None:
        """On the route to decode rank 0, behind its layers' sends (awaited to completion),
        with any drafts (speculative decoding); the other routes need nothing more."""
        sender = next((s for route, s in self.routes if route.first_token), None)
        if sender is None:
            raise ValueError(f"transfer {self.transfer_id}: rank {self._own.rank} has no route "
                             "that carries the first token")  # fmt: skip
        if self._first_route_sends:
            await asyncio.wait(set(self._first_route_sends), timeout=sender.remaining_s)
        await sender.send_first_token(token_id, logprob, finish_reason, draft_token_ids)

    def _slice(self, payload: torch.Tensor, start: int, end: int) -> torch.Tensor:
        num_blocks = payload.numel() // self._rank_layout.bytes_per_block
        return slice_packed(payload, self._rank_layout, num_blocks, start, end)
