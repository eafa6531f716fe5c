"""Routing policies: round robin, least loaded, prefix aware, and conditional disaggregation
(short prompts and saturated prefill pools prefill on the decode node)."""

from __future__ import annotations

import dataclasses
import time
from types import SimpleNamespace

import pytest

from pdserve.registry import NodeLoadReport, NodeRecord
from pdserve.sampling_params import SamplingParams
from pdserve.v1 import node_pb2
from router.input_processor import ProcessedRequest
from router.node_load import NodeLoad
from router.policies import LeastLoadedPolicy, RoundRobinPolicy, make_policy
from router.policies.prefix_aware import (
    PREFIX_BALANCE_ABS_TOKENS,
    PrefixAwarePolicy,
    PrefixIndex,
    block_hashes,
)

BLOCK_SIZE = 4


def node(address: str, **report: int) -> SimpleNamespace:
    """A stand-in for a NodeClient: address, NodeInfo, NodeLoad (with a report if given)."""
    load = NodeLoad()
    if report:
        load.update(_record(address, num_kv_blocks=report.pop("num_kv_blocks", 64), **report))
    return SimpleNamespace(
        address=address, info=node_pb2.NodeInfo(block_size=BLOCK_SIZE), load=load
    )


def _record(address: str, num_kv_blocks: int, **load: int) -> NodeRecord:
    return NodeRecord(
        node_id=address, role="decode", address=address, kv_address="", model_name="m",
        layout_hash="h", protocol_version=1, kv_transport="tcp", block_size=BLOCK_SIZE,
        max_model_len=1024, num_kv_blocks=num_kv_blocks, max_num_seqs=8,
        load=NodeLoadReport(**load), heartbeat_s=1.0, ttl_s=3.0, updated_at_s=0.0,
    )  # fmt: skip


def request(prompt: list[int] | int = 8, max_tokens: int = 8) -> ProcessedRequest:
    token_ids = list(range(3, 3 + prompt)) if isinstance(prompt, int) else prompt
    return ProcessedRequest(
        request_id="r",
        prompt_token_ids=token_ids,
        sampling_params=SamplingParams(max_tokens=max_tokens),
        node_sampling=node_pb2.NodeSamplingParams(),
    )


def test_round_robin_cycles_each_pool_independently() -> None:
    policy = RoundRobinPolicy()
    prefill = [node("p0"), node("p1")]
    decode = [node("d0"), node("d1"), node("d2")]

    routes = [policy.pick(request(), prefill, decode) for _ in range(6)]

    assert [r.prefill.address for r in routes] == ["p0", "p1"] * 3
    assert [r.decode.address for r in routes] == ["d0", "d1", "d2"] * 2


def test_without_prefill_nodes_the_route_is_colocated() -> None:
    route = RoundRobinPolicy().pick(request(), [], [node("d0")])

    assert route.prefill is None and route.decode.address == "d0"
    assert route.local_reason == "colocated"


def test_a_route_needs_a_decode_node_and_a_known_policy() -> None:
    with pytest.raises(ValueError, match="at least one decode node"):
        RoundRobinPolicy().pick(request(), [node("p0")], [])
    with pytest.raises(ValueError, match="unknown routing policy 'fastest'"):
        make_policy("fastest")
    assert isinstance(make_policy("prefix_aware", 16, 100), PrefixAwarePolicy)


@pytest.mark.parametrize("name", ["round_robin", "least_loaded", "prefix_aware"])
def test_prompts_up_to_the_local_prefill_limit_skip_the_prefill_pool(name: str) -> None:
    policy = make_policy(name, local_prefill_max_tokens=16)
    prefill, decode = [node("p0")], [node("d0")]

    short = policy.pick(request(16), prefill, decode)
    long = policy.pick(request(17), prefill, decode)

    assert (short.prefill, short.local_reason) == (None, "short_prompt")
    assert long.prefill.address == "p0" and long.local_reason == ""


def test_a_saturated_prefill_pool_sends_prompts_to_the_decode_node() -> None:
    policy = make_policy("least_loaded", prefill_saturation_tokens=100)
    busy, idle = node("p0", num_queued_prefill_tokens=100), node("p1")
    decode = [node("d0")]

    assert policy.pick(request(), [busy, idle], decode).prefill is idle
    idle.load.track(100)  # in flight from this router, not yet in any report
    route = policy.pick(request(), [busy, idle], decode)
    assert (route.prefill, route.local_reason) == (None, "prefill_saturated")
    off = make_policy("least_loaded", prefill_saturation_tokens=0)
    assert off.pick(request(), [busy, idle], decode).prefill is not None


def test_least_loaded_prefill_takes_the_fewest_queued_tokens() -> None:
    policy = LeastLoadedPolicy()
    prefill = [node("p0", num_queued_prefill_tokens=500), node("p1", num_queued_prefill_tokens=20)]

    assert policy.pick(request(), prefill, [node("d0")]).prefill.address == "p1"


def test_least_loaded_decode_weighs_kv_in_use_and_skips_nodes_without_room() -> None:
    policy = LeastLoadedPolicy()
    # d0: 56 of 64 blocks in use; d1: 10 in use; d2: nearly empty but too small for the prompt
    d0 = node("d0", num_kv_blocks=64, num_free_kv_blocks=8)
    d1 = node("d1", num_kv_blocks=64, num_free_kv_blocks=54)
    d2 = node("d2", num_kv_blocks=4, num_free_kv_blocks=3)

    assert policy.pick(request(8), [], [d0, d1]).decode is d1
    assert policy.pick(request(20), [], [d0, d1, d2]).decode is d1  # 6 blocks: d2 has 3
    assert policy.pick(request(20), [], [d0, d2]).decode is d0  # fits; d2 does not


def test_least_loaded_spreads_a_burst_before_any_report_and_rotates_ties() -> None:
    policy = LeastLoadedPolicy()
    decode = [node("d0"), node("d1"), node("d2")]

    idle_picks = [policy.pick(request(), [], decode).decode.address for _ in range(3)]
    burst = []
    for _ in range(6):  # each pick stays in flight: the router's own accounting
        chosen = policy.pick(request(8, max_tokens=8), [], decode).decode
        chosen.load.track(16)
        burst.append(chosen.address)

    assert sorted(idle_picks) == ["d0", "d1", "d2"]
    assert sorted(burst) == ["d0", "d0", "d1", "d1", "d2", "d2"]


def test_node_load_takes_the_larger_of_report_and_in_flight() -> None:
    load = node("d0", num_kv_blocks=10, num_free_kv_blocks=6, num_queued_prefill_tokens=3).load

    assert load.load_tokens == 4 * BLOCK_SIZE + 3
    work = load.track(100)
    assert load.load_tokens == 100 and load.queued_prefill_tokens == 100 and not load.idle
    work.done()
    work.done()  # idempotent
    assert load.num_inflight_tokens == 0 and load.idle


def test_work_finished_after_a_report_is_taken_off_it() -> None:
    load = node("p0", num_queued_prefill_tokens=52).load  # reported at unix time 0
    load.track(40).done()  # finished after that report

    assert load.queued_prefill_tokens == 12
    load.track(40).done()
    assert load.queued_prefill_tokens == 0  # never negative
    fresh = _record("p0", 64, num_queued_prefill_tokens=30)
    load.update(dataclasses.replace(fresh, updated_at_s=time.time() + 1))
    assert load.queued_prefill_tokens == 30  # the new report already saw those finish


def test_block_hashes_chain_full_blocks_only() -> None:
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    b = block_hashes([1, 2, 3, 4, 0, 6, 7, 8], 4)

    assert len(a) == 2 and len(b) == 2  # the partial last block is not hashed
    assert a[0] == b[0] and a[1] != b[1]
    assert block_hashes([9, 9, 9, 9, 5, 6, 7, 8], 4)[1] != a[1]  # block 1 depends on block 0
    assert block_hashes([1, 2, 3], 4) == []


def test_prefix_index_matches_the_longest_run_and_evicts_deep_blocks_first() -> None:
    index = PrefixIndex(max_entries=3)
    index.insert([10, 11], "p0")
    index.insert([10, 11, 12], "p1")

    assert index.match([10, 11, 12, 13], ["p0", "p1"]) == "p1"
    assert index.match([10, 11, 12], ["p0"]) is None  # p1 owns the run now
    assert index.match([99], ["p0", "p1"]) is None
    index.insert([20, 21], "p0")  # 4 hashes > 3: the oldest, deepest one goes
    assert len(index) == 3
    assert index.match([10, 11, 12], ["p0", "p1"]) == "p1"  # via block 11
    assert index.match([10], ["p1"]) == "p1"


def test_prefix_aware_keeps_a_shared_prefix_on_one_prefill_node() -> None:
    policy = PrefixAwarePolicy()
    prefill = [node("p0"), node("p1")]
    decode = [node("d0"), node("d1")]
    groups = [[g] * 8 for g in (100, 200, 300, 400)]  # 2 full blocks of prefix each

    chosen: dict[int, set[str]] = {g[0]: set() for g in groups}
    for suffix in range(4):
        for prefix in groups:
            route = policy.pick(request(prefix + [suffix + 3]), prefill, decode)
            chosen[prefix[0]].add(route.prefill.address)

    assert all(len(nodes) == 1 for nodes in chosen.values()), chosen
    assert {next(iter(nodes)) for nodes in chosen.values()} == {"p0", "p1"}  # new ones spread


def test_prefix_aware_leaves_a_much_busier_node_for_the_least_loaded() -> None:
    policy = PrefixAwarePolicy()
    p0, p1 = node("p0"), node("p1")
    prompt = [7] * 12
    first = policy.pick(request(prompt), [p0, p1], [node("d0")]).prefill
    other = p1 if first is p0 else p0

    first.load.track(PREFIX_BALANCE_ABS_TOKENS)  # busier, but not by enough
    assert policy.pick(request(prompt), [p0, p1], [node("d0")]).prefill is first
    first.load.track(PREFIX_BALANCE_ABS_TOKENS)
    assert policy.pick(request(prompt), [p0, p1], [node("d0")]).prefill is other
    assert policy.prefill_index.match(block_hashes(prompt, BLOCK_SIZE), ["p0", "p1"]) == (
        other.address
    )


def test_prefix_aware_local_prefill_picks_the_decode_node_by_prefix() -> None:
    policy = PrefixAwarePolicy(local_prefill_max_tokens=64)
    decode = [node("d0"), node("d1"), node("d2")]
    prompt = [5] * 16

    picks = {
        policy.pick(request(prompt + [i]), [node("p0")], decode).decode.address for i in range(5)
    }

    assert len(picks) == 1
