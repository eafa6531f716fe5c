"""KV hand-offs between tensor-parallel sizes: every prefill rank sends its own kv heads
straight to the decode rank(s) holding them, one route session per such pair (README.md,
"Tensor parallelism")."""

from cache_transfer.tp.fan_in import FanIn
from cache_transfer.tp.fan_out import FanOutSender, TicketRefused
from cache_transfer.tp.head_routes import RankHeads, Route, plan_routes
from cache_transfer.tp.route_tickets import DecodeRank, decode_ranks
from cache_transfer.tp.session_group import RemotePart, SessionGroup
from cache_transfer.tp.tp_receiver import TPReceiver

__all__ = [
    "DecodeRank", "FanIn", "FanOutSender", "RankHeads", "RemotePart", "Route", "SessionGroup",
    "TPReceiver", "TicketRefused", "decode_ranks", "plan_routes",
]  # fmt: skip
