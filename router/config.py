"""RouterConfig: what one router serves, where its nodes are, how it routes, and how long it
waits for them."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.cli import (
    DEFAULT_HOST,
    DEFAULT_PREFILL_SATURATION_TOKENS,
    DEFAULT_ROUTER_PORT,
    POLICIES,
)
from pdserve.registry import RegistryConfig


@dataclass(frozen=True)
class RouterConfig:
    host: str = DEFAULT_HOST
    port: int = DEFAULT_ROUTER_PORT  # 0: a free port
    prefill_addrs: tuple[str, ...] = ()  # none: colocated mode (decode nodes prefill locally)
    decode_addrs: tuple[str, ...] = ()
    registry: RegistryConfig | None = None  # discover nodes there too (they join and leave)
    policy: str = "round_robin"  # one of POLICIES
    local_prefill_max_tokens: int = 0  # prompts this short prefill on their decode node; 0: off
    # A prefill node with this many queued prompt tokens is saturated; when all are, prompts
    # prefill on their decode node. 0: off.
    prefill_saturation_tokens: int = DEFAULT_PREFILL_SATURATION_TOKENS
    node_wait_s: float = 60.0  # how long start() retries nodes that are not up yet
    node_rpc_timeout_s: float = 5.0  # GetNodeInfo, GetTokenizer, CancelTransfer, Abort
    ticket_timeout_s: float = 30.0  # D's first message (TransferTicket) in disaggregated mode
    transfer_timeout_s: float = 30.0  # sent to D; also the deadline of P's Prefill call
    token_timeout_s: float = 120.0  # the longest wait for the next message of a request
    grace_s: float = 5.0  # graceful stop: in-flight requests get this long

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; expected one of {POLICIES}")
        for name in ("local_prefill_max_tokens", "prefill_saturation_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0: off), got {getattr(self, name)}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        for name in (
            "node_wait_s",
            "node_rpc_timeout_s",
            "ticket_timeout_s",
            "transfer_timeout_s",
            "token_timeout_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if self.grace_s < 0:
            raise ValueError(f"grace_s must be >= 0 seconds, got {self.grace_s}")
        addrs = [*self.prefill_addrs, *self.decode_addrs]
        if any(not a or ":" not in a for a in addrs):
            raise ValueError(f"node addresses must be HOST:PORT, got {addrs}")
        if len(set(addrs)) != len(addrs):
            raise ValueError(f"a node address is listed twice: {addrs}")
