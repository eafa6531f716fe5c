"""Where a request's time to first token goes (`pd-bench ttft --breakdown`): the client's send
and first-token times, the router's milestones (a traced request: `pdserve-trace`,
router/request_record.py) and, for 1P1D, the nodes' marks of that request (`GetStats`
`last_transfer`), all `time.monotonic()` of one host.

```
TTFT chain (rows add up to the client's TTFT)      side chain (1P1D: D's ticket, off the path
  client -> router                                  unless P waits for it)
  router: validate, tokenize                          router -> D (Decode arrives)
  router: pick the route                              D: reserve blocks, ticket
  router: start the node call(s)                      D -> router: ticket
  node leg: call -> first token in                    router -> P: AttachTicket
    router -> P (Prefill arrives)                     P's ticket in, before its first token
    P: queue                                          D: KV + first token in, after P's
    P: prefill
    P -> router: first token
  router: first token out
  router -> client
```
Colocated requests have no node marks (a local prefill is no hand-off): their node leg is one
row. Each row is the median over the measured requests.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from pdserve.v1 import node_pb2

LEG = "node leg: call -> first token in"
TTFT_ROWS = [
    "client -> router", "router: validate, tokenize", "router: pick the route",
    "router: start the node call(s)", LEG, "  router -> P (Prefill arrives)", "  P: queue",
    "  P: prefill", "  P -> router: first token", "router: first token out", "router -> client",
    "TTFT (client)",
]  # fmt: skip
SIDE_ROWS = [
    "  router -> D (Decode arrives)", "  D: reserve blocks, ticket", "  D -> router: ticket",
    "  router -> P: AttachTicket", "  P's ticket in, ms before its first token",
    "  D: KV + first token in, ms after P's first token",
]  # fmt: skip


@dataclass
class RequestTimes:
    """One measured request: client times and the marks the router and nodes recorded."""

    sent_s: float
    first_token_s: float
    router: dict[str, float]
    prefill: dict[str, float] = field(default_factory=dict)
    decode: dict[str, float] = field(default_factory=dict)


def node_marks(timeline: node_pb2.LayerTimeline, client_request_id: str) -> dict[str, float]:
    """The timeline's marks if it is this request's (the router's id: client id + "." ...)."""
    if not timeline.request_id.startswith(client_request_id + "."):
        return {}
    return dict(timeline.marks_s)


def segments(times: RequestTimes) -> dict[str, float]:
    """Each row's ms for one request (a row whose marks are missing is left out)."""
    r, p, d = times.router, times.prefill, times.decode
    firsts = [r[k] for k in ("prefill_first_token", "decode_first_token") if k in r]
    first_in = min(firsts) if firsts else None
    call_s = r.get("prefill_sent", r.get("decode_sent"))
    spans = {
        "client -> router": (times.sent_s, r.get("received")),
        "router: validate, tokenize": (r.get("received"), r.get("processed")),
        "router: pick the route": (r.get("processed"), r.get("routed")),
        "router: start the node call(s)": (r.get("routed"), call_s),
        LEG: (call_s, first_in),
        "  router -> P (Prefill arrives)": (r.get("prefill_sent"), p.get("rpc")),
        "  P: queue": (p.get("rpc"), p.get("computing")),
        "  P: prefill": (p.get("computing"), p.get("first_token")),
        "  P -> router: first token": (p.get("first_token"), r.get("prefill_first_token")),
        "router: first token out": (first_in, r.get("first_token_out")),
        "router -> client": (r.get("first_token_out"), times.first_token_s),
        "TTFT (client)": (times.sent_s, times.first_token_s),
        "  router -> D (Decode arrives)": (r.get("decode_sent"), d.get("rpc")),
        "  D: reserve blocks, ticket": (d.get("rpc"), d.get("ticket")),
        "  D -> router: ticket": (d.get("ticket"), r.get("ticket")),
        "  router -> P: AttachTicket": (r.get("ticket"), p.get("ticket")),
        "  P's ticket in, ms before its first token": (p.get("ticket"), p.get("first_token")),
        "  D: KV + first token in, ms after P's first token": (
            p.get("first_token"), d.get("kv_done"),
        ),
    }  # fmt: skip
    return {
        name: (end - start) * 1e3
        for name, (start, end) in spans.items()
        if start is not None and end is not None
    }


def _median(rows: list[dict[str, float]], name: str) -> float | None:
    values = [row[name] for row in rows if name in row]
    return statistics.median(values) if values else None


def table(colocated: list[RequestTimes], pd: list[RequestTimes]) -> list[str]:
    """Median ms per row, colocated against 1P1D, and their difference."""
    c_rows, p_rows = [segments(t) for t in colocated], [segments(t) for t in pd]

    def cell(value: float | None) -> str:
        return f"{value:9.3f}" if value is not None else f"{'-':>9}"

    lines = [f"{'ms (median)':<52}{'colocated':>10}{'1P1D':>10}{'1P1D-col':>10}"]
    for title, names in (("TTFT chain", TTFT_ROWS), ("1P1D side chain (D's ticket)", SIDE_ROWS)):
        lines.append(f"-- {title}")
        for name in names:
            c, p = _median(c_rows, name), _median(p_rows, name)
            diff = p - c if c is not None and p is not None else None
            lines.append(f"{name:<52}{cell(c):>10}{cell(p):>10}{cell(diff):>10}")
    return lines
