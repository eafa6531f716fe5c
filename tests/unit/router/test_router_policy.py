"""RoundRobinPolicy: each pool in turn; colocated when no prefill node is ready."""

from __future__ import annotations

import pytest

from router.policy import RoundRobinPolicy, make_policy


def test_round_robin_cycles_each_pool_independently() -> None:
    policy = RoundRobinPolicy()
    prefill, decode = ["p0", "p1"], ["d0", "d1", "d2"]

    routes = [policy.pick(8, prefill, decode) for _ in range(6)]

    assert [r.prefill for r in routes] == ["p0", "p1"] * 3
    assert [r.decode for r in routes] == ["d0", "d1", "d2"] * 2


def test_without_prefill_nodes_the_route_is_colocated() -> None:
    route = RoundRobinPolicy().pick(8, [], ["d0"])

    assert route.prefill is None and route.decode == "d0"


def test_a_route_needs_a_decode_node_and_a_known_policy() -> None:
    with pytest.raises(ValueError, match="at least one decode node"):
        RoundRobinPolicy().pick(8, ["p0"], [])
    with pytest.raises(ValueError, match="unknown routing policy 'fastest'"):
        make_policy("fastest")
