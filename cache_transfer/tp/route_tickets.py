"""A tensor-parallel hand-off's ticket, read rank by rank, and each route's own ticket.

```
decode_ranks(ticket, num_kv_heads)   the decode node's ranks: TP 1 (no `ranks`): rank 0 at
                                     dst_address with every head; else the signed list
route_ticket(auth, ticket, route, dst, layout)
                                     the ticket a route's session runs on: its own transfer id
                                     (route_id), the decode rank's address and device, the head
                                     slice's layout hash; blocks, tokens, held blocks (the
                                     suffix), KV cache dtype and expiry the whole's; with a
                                     cluster secret signed as it is (seal_ticket)
```

Both ends derive a route's ticket the same way from the whole (the prefill rank after checking
the whole's signature, the decode rank from the ticket its rank 0 issued), so the route's
handshake proof verifies as a TP 1 one does, on whatever session authentication the sessions
have.
"""

from __future__ import annotations

from dataclasses import dataclass

from cache_transfer.layout import KVLayout
from cache_transfer.tickets import seal_ticket
from cache_transfer.tp.head_routes import RankHeads, Route, route_id
from pdserve.security import ClusterAuth
from pdserve.v1 import node_pb2


@dataclass(frozen=True)
class DecodeRank:
    """One rank of the decode node: where its KV transport listens and what its pool holds."""

    heads: RankHeads
    address: str
    kv_device: str


def decode_ranks(ticket: node_pb2.TransferTicket, num_kv_heads: int) -> list[DecodeRank]:
    """The ranks a ticket names (ValueError when its list is malformed: not ranks 0..n-1, or
    tp_size disagrees with it)."""
    if ticket.tp_size <= 1 and not ticket.ranks:
        return [DecodeRank(RankHeads(0, 0, num_kv_heads), ticket.dst_address, ticket.kv_device)]
    if ticket.tp_size != len(ticket.ranks):
        raise ValueError(
            f"the ticket says tp_size {ticket.tp_size} and lists {len(ticket.ranks)} ranks"
        )
    ranks = [
        DecodeRank(RankHeads(r.rank, r.kv_head_start, r.kv_head_end), r.address, r.kv_device)
        for r in ticket.ranks
    ]
    if any(not r.address for r in ranks):
        raise ValueError("the ticket lists a decode rank without an address")
    return ranks


def rank_endpoints(ranks: list[DecodeRank]) -> list[node_pb2.RankEndpoint]:
    """What a ticket lists of a tensor-parallel decode node's ranks."""
    return [
        node_pb2.RankEndpoint(
            rank=r.heads.rank,
            address=r.address,
            kv_head_start=r.heads.kv_head_start,
            kv_head_end=r.heads.kv_head_end,
            kv_device=r.kv_device,
        )  # fmt: skip
        for r in ranks
    ]


def route_ticket(
    auth: ClusterAuth | None,
    ticket: node_pb2.TransferTicket,
    route: Route,
    dst: DecodeRank,
    layout: KVLayout,
) -> node_pb2.TransferTicket:
    """`route`'s ticket (see the module doc); `layout`: the route's head slice's."""
    derived = node_pb2.TransferTicket(
        transfer_id=route_id(ticket.transfer_id, route),
        dst_address=dst.address,
        dst_block_ids=ticket.dst_block_ids,
        layout_hash=layout.layout_hash(),
        num_tokens=ticket.num_tokens,
        expires_at_unix_s=ticket.expires_at_unix_s,
        kv_device=dst.kv_device,
        num_cached_blocks=ticket.num_cached_blocks,  # every route skips the blocks D holds
        kv_cache_dtype=ticket.kv_cache_dtype,
    )
    if auth is not None:
        seal_ticket(auth, derived)
    return derived
