"""Which prefill rank sends which kv heads to which decode rank, and how a route is named.

```
prefill TP a: rank i holds kv heads [p_i, p_i')      decode TP b: rank j holds [d_j, d_j')
plan_routes: for each decode rank j, each head it holds comes from the lowest prefill rank
             that holds it (replicated heads: one sender per head); consecutive heads of one
             sender form one Route(src_rank i, dst_rank j, [start, end))
e.g. 8 heads, a=2 -> b=1: (0->0 [0,4)), (1->0 [4,8))     a=1 -> b=2: (0->0 [0,4)), (0->1 [4,8))
     2 heads, a=4 (replicated: ranks 0,1 hold head 0; 2,3 head 1) -> b=1: (0->0 [0,1)),
     (2->0 [1,2)); ranks 1 and 3 send nothing
```

The route from prefill rank 0 to decode rank 0 always exists (both hold head 0) and carries
the first token. A route's session is named `<transfer_id>:<a>.<i>><j>:<start>-<end>`
(`route_id`), so the decode rank that gets its first message knows the slice without asking.
Torch-free; the ranks' heads come from the engine's partition (prefill) and the ticket
(decode).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from cache_transfer.layout import HeadSlice
from cache_transfer.route_slice import ROUTE_SEPARATOR


@dataclass(frozen=True)
class RankHeads:
    """The kv heads `[kv_head_start, kv_head_end)` one rank's pool holds."""

    rank: int
    kv_head_start: int
    kv_head_end: int

    def holds(self, head: int) -> bool:
        return self.kv_head_start <= head < self.kv_head_end


@dataclass(frozen=True)
class Route:
    """The kv heads `[kv_head_start, kv_head_end)` sent from prefill rank `src_rank` (of a
    node of `src_tp_size` ranks) to decode rank `dst_rank`."""

    src_tp_size: int
    src_rank: int
    dst_rank: int
    kv_head_start: int
    kv_head_end: int

    @property
    def num_kv_heads(self) -> int:
        return self.kv_head_end - self.kv_head_start

    @property
    def first_token(self) -> bool:
        """The first token travels on this route (prefill rank 0 -> decode rank 0)."""
        return self.src_rank == 0 and self.dst_rank == 0

    @property
    def heads(self) -> HeadSlice:
        """What its handshake says it carries."""
        return HeadSlice(self.kv_head_start, self.kv_head_end, self.src_tp_size, self.src_rank)


def check_ranks(ranks: Sequence[RankHeads], num_kv_heads: int, side: str) -> None:
    """ValueError unless `ranks` are ranks 0..n-1, each holding a non-empty range inside the
    model's `num_kv_heads`, together holding every head."""
    if not ranks:
        raise ValueError(f"the {side} node lists no ranks")
    if [r.rank for r in ranks] != list(range(len(ranks))):
        raise ValueError(f"the {side} node's ranks are {[r.rank for r in ranks]}, not 0..n-1")
    for r in ranks:
        if not 0 <= r.kv_head_start < r.kv_head_end <= num_kv_heads:
            raise ValueError(
                f"{side} rank {r.rank} holds kv heads [{r.kv_head_start}, {r.kv_head_end}), "
                f"outside the model's {num_kv_heads}"
            )
    missing = [h for h in range(num_kv_heads) if not any(r.holds(h) for r in ranks)]
    if missing:
        raise ValueError(f"no {side} rank holds kv heads {missing[:8]}")


def plan_routes(
    src: Sequence[RankHeads], dst: Sequence[RankHeads], num_kv_heads: int
) -> list[Route]:
    """Every route of a hand-off from prefill ranks `src` to decode ranks `dst` (see the
    module doc); ValueError naming both sizes when one side cannot be matched."""
    try:
        check_ranks(src, num_kv_heads, "prefill")
        check_ranks(dst, num_kv_heads, "decode")
    except ValueError as error:
        raise ValueError(
            f"a prefill node of tensor-parallel size {len(src)} cannot hand its KV over to a "
            f"decode node of size {len(dst)} ({num_kv_heads} kv heads): {error}"
        ) from None
    routes: list[Route] = []
    for d in dst:
        for head in range(d.kv_head_start, d.kv_head_end):
            sender = next(s.rank for s in src if s.holds(head))
            last = routes[-1] if routes else None
            if last and (last.dst_rank, last.src_rank, last.kv_head_end) == (d.rank, sender, head):
                routes[-1] = Route(len(src), sender, d.rank, last.kv_head_start, head + 1)
            else:
                routes.append(Route(len(src), sender, d.rank, head, head + 1))
    return routes


def route_id(transfer_id: str, route: Route) -> str:
    """The name of `route`'s session: `<transfer_id>:<a>.<i>><j>:<start>-<end>`."""
    sep = ROUTE_SEPARATOR
    return (
        f"{transfer_id}{sep}{route.src_tp_size}.{route.src_rank}>{route.dst_rank}{sep}"
        f"{route.kv_head_start}-{route.kv_head_end}"
    )


_ROUTE = re.compile(r"^(\d{1,4})\.(\d{1,4})>(\d{1,4})" + ROUTE_SEPARATOR + r"(\d{1,5})-(\d{1,5})$")


def parse_route_id(session_id: str) -> tuple[str, Route] | None:
    """(transfer_id, route) of a route's session name, or None when it names no route."""
    transfer_id, sep, rest = session_id.partition(ROUTE_SEPARATOR)
    match = _ROUTE.match(rest) if sep and transfer_id else None
    if match is None:
        return None
    tp_size, src, dst, start, end = map(int, match.groups())
    if not (src < tp_size and start < end):
        return None
    return transfer_id, Route(tp_size, src, dst, start, end)
