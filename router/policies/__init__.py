"""Routing policies: which prefill node (or none) and which decode node serve a request.

| module | policy |
| --- | --- |
| `base` | `RoutingPolicy` (conditional disaggregation, shared), `Route` |
| `round_robin` | `RoundRobinPolicy`: each node in turn |
| `least_loaded` | `LeastLoadedPolicy`: fewest outstanding tokens, among nodes with KV room |
| `prefix_aware` | `PrefixAwarePolicy`, `PrefixIndex`: shared prefixes to the node holding them |

`make_policy(name, ...)` is the factory (names: `POLICIES`).
"""

from __future__ import annotations

from router.policies.base import LOCAL_REASONS, Route, RoutingPolicy
from router.policies.least_loaded import LeastLoadedPolicy
from router.policies.prefix_aware import PrefixAwarePolicy
from router.policies.round_robin import RoundRobinPolicy

POLICIES: dict[str, type[RoutingPolicy]] = {
    "round_robin": RoundRobinPolicy,
    "least_loaded": LeastLoadedPolicy,
    "prefix_aware": PrefixAwarePolicy,
}

__all__ = [
    "LOCAL_REASONS",
    "POLICIES",
    "LeastLoadedPolicy",
    "PrefixAwarePolicy",
    "RoundRobinPolicy",
    "Route",
    "RoutingPolicy",
    "make_policy",
]


def make_policy(
    name: str,
    local_prefill_max_tokens: int = 0,
    prefill_saturation_tokens: int = 0,
    prefix_cache_salt: str | None = None,
) -> RoutingPolicy:
    """The policy called `name` (one of pdserve.cli.POLICIES); `prefix_cache_salt` salts the
    prefix-aware policy's block hashes (pdserve.block_hash), as the nodes' engines do."""
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; available: {', '.join(POLICIES)}")
    if POLICIES[name] is PrefixAwarePolicy:
        return PrefixAwarePolicy(
            local_prefill_max_tokens, prefill_saturation_tokens, prefix_cache_salt
        )
    return POLICIES[name](local_prefill_max_tokens, prefill_saturation_tokens)
