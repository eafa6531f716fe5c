"""Suffix-only hand-offs through both node servers (issue 38): a conversation's second turn on
the decode node that holds its first sends only the new blocks (counted on both sides, the
held ones as skipped) and gives the greedy tokens of an engine with prefix caching off; only
verified KV is reused (an open cluster never caches received KV, so it sends everything); the
held blocks survive a pool squeezed between the reservation and the KV's arrival; and
`--no-suffix-handoff` sends the whole prompt."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from pdserve.config import SecurityConfig
from pdserve.grpc_security import open_channel
from pdserve.security import load_cluster_auth
from pdserve.v1 import node_pb2, node_pb2_grpc
from tests.unit.decode_node.node_harness import (
    BLOCK_SIZE,
    GREEDY,
    MODEL,
    RPC_TIMEOUT_S,
    Nodes,
    decode_request,
    engine_config,
    open_second_turn,
    prompt,
    read_chunks,
    read_prefill,
    read_ticket,
    run,
    run_disaggregated,
    run_local,
    running_nodes,
    tokens_of,
    wait_until,
)

pytestmark = pytest.mark.timeout(180)

TURN_1 = prompt(23, seed=21)
NEW_TOKENS = prompt(9, seed=22)  # the user's next message


def cold_tokens(prompt_ids: list[int]) -> list[int]:
    """Greedy tokens of an engine with prefix caching off (nothing reused)."""
    llm = LLM(MODEL, device="cpu", dtype="float32", block_size=BLOCK_SIZE, num_blocks=64,
              enable_prefix_caching=False)  # fmt: skip
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, seed=7)
    return llm.generate([prompt_ids], params)[0].token_ids


def metric(nodes: Nodes, role: str, name: str, **labels: str) -> float:
    node = nodes.prefill if role == "prefill" else nodes.decode
    value = node.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def secured(tmp_path: Path) -> SecurityConfig:
    secret = tmp_path / "secret"
    secret.write_text("a-cluster-secret-0123456789abcdef\n")
    return SecurityConfig(cluster_secret_file=str(secret))


def sign_calls(nodes: Nodes, security: SecurityConfig) -> None:
    """Our stubs prove the cluster secret, as the router's do."""
    auth = load_cluster_auth(security)
    channels = [open_channel(n.address, security, auth) for n in (nodes.prefill, nodes.decode)]
    nodes.channels.extend(channels)
    nodes.prefill_stub = node_pb2_grpc.PrefillNodeStub(channels[0])
    nodes.decode_stub = node_pb2_grpc.DecodeNodeStub(channels[1])


def layer_bytes(nodes: Nodes, num_blocks: int) -> int:
    layout = nodes.decode.layout
    return layout.num_layers * layout.layer_bytes(num_blocks)


def test_a_second_turn_sends_only_its_new_blocks(tmp_path: Path) -> None:
    security = secured(tmp_path)

    async def main() -> None:
        async with running_nodes("tcp", security=security, check_free=False) as nodes:
            sign_calls(nodes, security)
            first = await run_disaggregated(nodes, "turn-1", TURN_1)
            assert first.ticket.num_cached_blocks == 0
            turn_2 = TURN_1 + first.token_ids + NEW_TOKENS  # as a chat client re-sends it
            second = await run_disaggregated(nodes, "turn-2", turn_2)
            assert second.transfer_result.ok, second.transfer_result.error
            assert second.token_ids == cold_tokens(turn_2)
            # D computed turn 1's prompt and all but its last answer token: 34 tokens, 8 blocks
            num_cached = (len(TURN_1) + len(first.token_ids) - 1) // BLOCK_SIZE
            assert second.ticket.num_cached_blocks == num_cached
            num_sent = -(-len(turn_2) // BLOCK_SIZE) - num_cached
            assert (
                len(second.ticket.dst_block_ids) == -(-(len(turn_2) + 1) // BLOCK_SIZE) - num_cached
            )
            assert second.transfer_result.num_bytes == layer_bytes(nodes, num_sent)
            assert second.chunks[-1].num_cached_tokens == num_cached * BLOCK_SIZE
            full_1 = layer_bytes(nodes, -(-len(TURN_1) // BLOCK_SIZE))
            for role, direction in (("prefill", "sent"), ("decode", "received")):
                moved = metric(nodes, role, "pdserve_node_kv_transfer_bytes_total",
                               direction=direction)  # fmt: skip
                skipped = metric(nodes, role, "pdserve_node_kv_transfer_skipped_bytes_total",
                                 direction=direction)  # fmt: skip
                assert moved == full_1 + layer_bytes(nodes, num_sent), role
                assert skipped == layer_bytes(nodes, num_cached), role
                per_handoff = "pdserve_node_kv_handoff_bytes_sum"
                assert metric(nodes, role, per_handoff, direction=direction, part="skipped") == (
                    skipped
                )
            assert nodes.decode.core.stats().prefix_cache_hit_tokens >= num_cached * BLOCK_SIZE
            await nodes.decode.engine.check_no_leaks()
            await nodes.prefill.engine.check_no_leaks()

    run(main())


def test_an_open_cluster_reuses_no_received_kv() -> None:
    """No secret: turn 1's received KV never entered the cache, so turn 2 goes whole."""

    async def main() -> None:
        async with running_nodes("tcp") as nodes:
            first = await run_disaggregated(nodes, "turn-1", TURN_1)
            turn_2 = TURN_1 + first.token_ids + NEW_TOKENS
            second = await run_disaggregated(nodes, "turn-2", turn_2)
            assert second.ticket.num_cached_blocks == 0
            assert second.transfer_result.num_bytes == layer_bytes(
                nodes, -(-len(turn_2) // BLOCK_SIZE)
            )
            assert second.token_ids == cold_tokens(turn_2)

    run(main())


def test_held_blocks_survive_a_squeezed_pool() -> None:
    """Turn 1 ran on the decode node (local prefill: its own KV is cached); after turn 2's
    ticket, a long local request takes every other block of the pool, evicting whatever it
    can, before the prefill node sends: the held prefix is intact and the tokens are right."""

    async def main() -> None:
        async with running_nodes("tcp") as nodes:
            second = await open_second_turn(nodes, TURN_1, NEW_TOKENS)
            answer, turn_2, call, ticket = second.answer, second.prompt, second.call, second.ticket
            assert ticket.num_cached_blocks == (len(TURN_1) + len(answer) - 1) // BLOCK_SIZE
            free = (await nodes.stats())[1].num_free_kv_blocks
            squeeze = prompt(free * BLOCK_SIZE - GREEDY.max_tokens - 1, seed=23)
            # it needs every block free or evictable (the held prefix would be, unheld)
            assert -(-(len(squeeze) + GREEDY.max_tokens) // BLOCK_SIZE) == free
            await run_local(nodes, "squeeze", squeeze)
            prefill = nodes.prefill_stub.Prefill(
                node_pb2.PrefillRequest(request_id="turn-2", prompt_token_ids=turn_2,
                                        sampling=GREEDY, ticket=ticket),
                timeout=RPC_TIMEOUT_S,
            )  # fmt: skip
            _, result = await read_prefill(prefill)
            assert result.transfer_result.ok
            assert tokens_of(await read_chunks(call)) == cold_tokens(turn_2)

    run(main())


def test_no_suffix_handoff_sends_the_whole_prompt(tmp_path: Path) -> None:
    security = secured(tmp_path)

    async def main() -> None:
        async with running_nodes(
            "tcp", security=security, check_free=False, suffix_handoff=False
        ) as nodes:
            sign_calls(nodes, security)
            first = await run_disaggregated(nodes, "turn-1", TURN_1)
            turn_2 = TURN_1 + first.token_ids + NEW_TOKENS
            second = await run_disaggregated(nodes, "turn-2", turn_2)
            assert second.ticket.num_cached_blocks == 0
            assert second.token_ids == cold_tokens(turn_2)
            assert metric(nodes, "decode", "pdserve_node_kv_transfer_skipped_bytes_total",
                          direction="received") == 0  # fmt: skip

    run(main())


def test_layers_packed_before_the_ticket_are_cut_to_the_suffix() -> None:
    """The router starts the prefill before the decode node's ticket is in: every layer is
    packed whole, then the ticket says the decode node holds the first blocks: only the rest
    goes (a copy of each packed layer's suffix), and the tokens are right."""

    async def main() -> None:
        async with running_nodes("tcp") as nodes:
            second = await open_second_turn(nodes, TURN_1, NEW_TOKENS)
            turn_2, decode, ticket = second.prompt, second.call, second.ticket
            assert ticket.num_cached_blocks > 0
            prefill = nodes.prefill_stub.Prefill(
                node_pb2.PrefillRequest(request_id="turn-2", prompt_token_ids=turn_2,
                                        sampling=GREEDY),
                timeout=RPC_TIMEOUT_S,
            )  # fmt: skip
            num_layers = nodes.prefill.layout.num_layers
            outgoing = nodes.prefill.streamer._outgoing

            def all_packed() -> bool:
                queued = outgoing.get("turn-2")
                return queued is not None and len(queued.queued) == num_layers

            await wait_until(all_packed)
            assert all(layer.num_cached_blocks == 0 for layer in outgoing["turn-2"].queued)
            attach = node_pb2.AttachTicketRequest(request_id="turn-2", ticket=ticket)
            await nodes.prefill_stub.AttachTicket(attach, timeout=RPC_TIMEOUT_S)
            _, result = await read_prefill(prefill)
            assert result.transfer_result.ok, result.transfer_result.error
            num_sent = -(-len(turn_2) // BLOCK_SIZE) - ticket.num_cached_blocks
            assert result.transfer_result.num_bytes == layer_bytes(nodes, num_sent)
            assert tokens_of(await read_chunks(decode)) == cold_tokens(turn_2)

    run(main())


def test_the_held_prefix_is_the_requests_own_tenants() -> None:
    """A request's cache salt (its tenant's namespace) roots its lookup: the same tokens held
    for tenant a are no hit for tenant b, whose ticket asks for the whole prompt."""

    async def main() -> None:
        async with running_nodes("tcp") as nodes:
            turn_1 = decode_request("turn-1", TURN_1, disaggregated=False)
            turn_1.cache_salt = "tenant-a"
            answer = tokens_of(await read_chunks(nodes.decode_stub.Decode(turn_1)))
            turn_2 = TURN_1 + answer + NEW_TOKENS
            for salt, held in (("tenant-b", False), ("tenant-a", True)):
                request = decode_request(f"turn-2-{salt}", turn_2)
                request.cache_salt = salt
                call = nodes.decode_stub.Decode(request, timeout=RPC_TIMEOUT_S)
                ticket = await read_ticket(call)
                assert (ticket.num_cached_blocks > 0) == held, salt
                prefill = nodes.prefill_stub.Prefill(
                    node_pb2.PrefillRequest(request_id=request.request_id, cache_salt=salt,
                                            prompt_token_ids=turn_2, sampling=GREEDY,
                                            ticket=ticket),
                    timeout=RPC_TIMEOUT_S,
                )  # fmt: skip
                await read_prefill(prefill)
                assert tokens_of(await read_chunks(call)) == cold_tokens(turn_2)

    run(main())


def test_a_held_prefix_from_the_host_tier() -> None:
    """The decode node's device pool is too small to keep turn 1 between turns; its host tier
    keeps it: turn 2's reservation promotes the prefix (held like any hit), receives only the
    rest, decodes the cold tokens; both tiers pass the leak check."""
    decode_engine = engine_config(prefill_only=False, num_blocks=40)
    cache = dataclasses.replace(decode_engine.cache, kv_offload_memory=1 << 20)
    decode_engine = dataclasses.replace(decode_engine, cache=cache)

    async def main() -> None:
        async with running_nodes("tcp", decode_engine=decode_engine) as nodes:
            answer = await run_local(nodes, "turn-1", TURN_1)
            for i in range(3):  # other prompts take the whole device pool meanwhile
                await run_local(nodes, f"other-{i}", prompt(120, seed=40 + i))
            core = nodes.decode.core
            hits_before = core.stats().kv_offload.host_hit_tokens
            turn_2 = TURN_1 + answer + NEW_TOKENS
            second = await run_disaggregated(nodes, "turn-2", turn_2)
            assert second.ticket.num_cached_blocks == (len(TURN_1) + len(answer) - 1) // BLOCK_SIZE
            assert core.stats().kv_offload.host_hit_tokens > hits_before  # promoted
            assert second.token_ids == cold_tokens(turn_2)

    run(main())


def test_a_failed_suffix_hand_off_falls_back_to_a_local_prefill() -> None:
    """The prefill node never comes (the router cancels the transfer): the decode node frees
    the reservation (the held prefix goes back to its cache) and prefills locally, using that
    prefix again: the cold tokens, nothing leaked (running_nodes checks both pools)."""

    async def main() -> None:
        async with running_nodes("tcp") as nodes:
            second = await open_second_turn(nodes, TURN_1, NEW_TOKENS)
            turn_2, call, ticket = second.prompt, second.call, second.ticket
            assert ticket.num_cached_blocks > 0
            cancel = node_pb2.CancelTransferRequest(transfer_id=ticket.transfer_id, reason="test")
            assert (await nodes.decode_stub.CancelTransfer(cancel, timeout=RPC_TIMEOUT_S)).found
            chunks = await read_chunks(call)
            assert tokens_of(chunks) == cold_tokens(turn_2)
            assert nodes.decode.traces["turn-2"].prefilled_locally
            assert chunks[-1].num_cached_tokens == ticket.num_cached_blocks * BLOCK_SIZE

    run(main())
