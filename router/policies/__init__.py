"""Routing policies: which prefill node (or none) and which decode node serve a request.

| module | policy |
| --- | --- |
| `base` | `RoutingPolicy` (conditional disaggregation, shared), `Route` |
| `round_robin` | `RoundRobinPolicy`: each node in turn |
| `least_loaded` | `LeastLoadedPolicy`: fewest outstanding tokens, among nodes with KV room |
| `prefix_aware` | `PrefixAwarePolicy`, `PrefixIndex`: shared prefixes to the node holding them |
| `kv_events` | `KVEventsPolicy`: the nodes holding the prompt's longest prefix, as they report it |
| `kv_event_index` | `KVEventIndex`: exactly which block hashes each node holds |
| `kv_event_watchers` | `KVEventWatchers`: one `WatchKVEvents` stream per node, feeding the index |

`make_policy(name, ...)` is the factory (names: `POLICIES`).
"""

from __future__ import annotations

from router.policies.base import LOCAL_REASONS, Route, RoutingPolicy
from router.policies.kv_events import KVEventsPolicy
from router.policies.least_loaded import LeastLoadedPolicy
from router.policies.prefix_aware import PrefixAwarePolicy
from router.policies.round_robin import RoundRobinPolicy

POLICIES: dict[str, type[RoutingPolicy]] = {
    "round_robin": RoundRobinPolicy,
    "least_loaded": LeastLoadedPolicy,
    "prefix_aware": PrefixAwarePolicy,
    "kv_events": KVEventsPolicy,
}

__all__ = [
    "LOCAL_REASONS",
    "KVEventsPolicy",
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
    prefix-aware and kv_events policies' block hashes (pdserve.block_hash), as the nodes'
    engines do."""
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; available: {', '.join(POLICIES)}")
    salted = {"prefix_aware": PrefixAwarePolicy, "kv_events": KVEventsPolicy}.get(name)
    if salted is not None:
        return salted(local_prefill_max_tokens, prefill_saturation_tokens, prefix_cache_salt)
    return POLICIES[name](local_prefill_max_tokens, prefill_saturation_tokens)
