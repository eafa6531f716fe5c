"""A Prefill call whose ticket follows in AttachTicket (the router starts the prefill before the
decode node has reserved): the KV still lands token-exact, and every way the ticket can fail
(never comes, refused, sent twice, sent first) ends cleanly with nothing held (running_nodes
checks both pools whole and leak-free at the end of each test)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from engine import LLM, SamplingParams
from pdserve.v1 import node_pb2
from tests.unit.decode_node.node_harness import (
    BLOCK_SIZE,
    GREEDY,
    MODEL,
    NUM_BLOCKS,
    RPC_TIMEOUT_S,
    Nodes,
    decode_request,
    prompt,
    read_chunks,
    read_prefill,
    read_ticket,
    run,
    running_nodes,
    tokens_of,
    wait_until,
)

pytestmark = pytest.mark.timeout(120)


def prefill_without_ticket(
    nodes: Nodes, prompt_ids: list[int], request_id: str, ticket_timeout_s: float = 0.0
):
    request = node_pb2.PrefillRequest(
        request_id=request_id, prompt_token_ids=prompt_ids, sampling=GREEDY,
        ticket_timeout_s=ticket_timeout_s,
    )  # fmt: skip
    return nodes.prefill_stub.Prefill(request, timeout=RPC_TIMEOUT_S)


async def attach(nodes: Nodes, request_id: str, ticket: node_pb2.TransferTicket) -> None:
    request = node_pb2.AttachTicketRequest(request_id=request_id, ticket=ticket)
    await nodes.prefill_stub.AttachTicket(request, timeout=RPC_TIMEOUT_S)


@pytest.mark.parametrize("order", ["prefill-first", "ticket-first"])
def test_attached_ticket_hands_off_token_exact(order: str) -> None:
    """Prefill without a ticket, then AttachTicket (or the ticket first: two RPCs of a channel
    are not ordered): the decode node continues exactly as offline generation does."""
    prompt_ids = prompt(37, seed=11)
    llm = LLM(MODEL, device="cpu", dtype="float32", block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)
    greedy = SamplingParams(max_tokens=GREEDY.max_tokens, temperature=0.0, ignore_eos=True)
    (expected,) = llm.generate([prompt_ids], greedy)

    async def main() -> None:
        async with running_nodes("tcp") as nodes:
            decode = nodes.decode_stub.Decode(
                decode_request("a", prompt_ids), timeout=RPC_TIMEOUT_S
            )
            if order == "prefill-first":
                call = prefill_without_ticket(nodes, prompt_ids, "a")
                # the call waits for its ticket from its start until AttachTicket settles it
                await wait_until(lambda: nodes.prefill.servicer.num_tickets_held)
                await attach(nodes, "a", await read_ticket(decode))
            else:
                await attach(nodes, "a", await read_ticket(decode))
                call = prefill_without_ticket(nodes, prompt_ids, "a")
            first, result = await read_prefill(call)
            assert result.transfer_result.ok, result.transfer_result.error
            assert first.first_token.token_id == expected.token_ids[0]
            assert tokens_of(await read_chunks(decode)) == list(expected.token_ids)

    run(main())


@pytest.mark.parametrize("bound", ["request", "node"])
def test_no_ticket_in_time_is_deadline_exceeded_and_frees_blocks(bound: str) -> None:
    """The wait is the request's ticket_timeout_s (the router's), capped by the node's."""
    prompt_ids = prompt(20, seed=12)
    request_s, node_s = (0.5, 60.0) if bound == "request" else (60.0, 0.5)

    async def main() -> None:
        async with running_nodes("local", ticket_timeout_s=node_s) as nodes:
            call = prefill_without_ticket(nodes, prompt_ids, "late", ticket_timeout_s=request_s)
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await read_prefill(call)
            assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert "no AttachTicket within 0.5 s" in error.value.details()

    run(main())


NO_PROGRESS_S = 1.0


def test_a_ticket_later_than_the_no_progress_timeout_still_hands_off() -> None:
    """The decode node's reservation queued (its pool full): the ticket comes after the
    hand-off's no-progress timeout, within the ticket timeout, and the KV lands."""
    prompt_ids = prompt(20, seed=15)

    async def main() -> None:
        async with running_nodes("tcp", transfer_timeout_s=NO_PROGRESS_S) as nodes:
            call = prefill_without_ticket(nodes, prompt_ids, "slow", ticket_timeout_s=30.0)
            first = await asyncio.wait_for(call.read(), RPC_TIMEOUT_S)  # computed meanwhile
            assert first.WhichOneof("kind") == "first_token"
            await asyncio.sleep(2 * NO_PROGRESS_S)  # P still waits for its ticket
            assert nodes.prefill.servicer.num_tickets_held == 1
            decode = nodes.decode_stub.Decode(
                decode_request("slow", prompt_ids), timeout=RPC_TIMEOUT_S
            )
            await attach(nodes, "slow", await read_ticket(decode))
            result = await asyncio.wait_for(call.read(), RPC_TIMEOUT_S)
            assert result.transfer_result.ok, result.transfer_result.error
            chunks = await read_chunks(decode)
            assert tokens_of(chunks)[0] == first.first_token.token_id
            assert not any(c.prefilled_here for c in chunks)  # D resumed from the KV

    run(main())


def test_a_negative_ticket_timeout_is_invalid_argument() -> None:
    async def main() -> None:
        async with running_nodes("local") as nodes:
            call = prefill_without_ticket(nodes, prompt(8, seed=16), "neg", ticket_timeout_s=-1)
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await read_prefill(call)
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "ticket_timeout_s must be >= 0" in error.value.details()

    run(main())


def test_a_refused_attached_ticket_ends_the_call_with_its_status() -> None:
    """A ticket for another prompt length: INVALID_ARGUMENT (as an inline one), blocks free."""
    prompt_ids = prompt(20, seed=13)

    async def main() -> None:
        async with running_nodes("local") as nodes:
            decode = nodes.decode_stub.Decode(
                decode_request("r", prompt_ids[:-1], transfer_timeout_s=60.0),
                timeout=RPC_TIMEOUT_S,
            )
            ticket = await read_ticket(decode)  # for 19 tokens, not 20
            call = prefill_without_ticket(nodes, prompt_ids, "r")
            await attach(nodes, "r", ticket)
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await read_prefill(call)
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "the ticket is for 19 tokens" in error.value.details()
            decode.cancel()

    run(main())


def test_attach_ticket_refuses_a_second_ticket_and_an_empty_request_id() -> None:
    prompt_ids = prompt(12, seed=14)

    async def main() -> None:
        async with running_nodes("tcp") as nodes:
            decode = nodes.decode_stub.Decode(
                decode_request("d", prompt_ids), timeout=RPC_TIMEOUT_S
            )
            ticket = await read_ticket(decode)
            call = prefill_without_ticket(nodes, prompt_ids, "d")
            await attach(nodes, "d", ticket)
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await attach(nodes, "d", ticket)
            assert error.value.code() == grpc.StatusCode.ALREADY_EXISTS
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await attach(nodes, "", ticket)
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            _, result = await read_prefill(call)
            assert result.transfer_result.ok  # the first ticket still counts
            await asyncio.wait_for(read_chunks(decode), RPC_TIMEOUT_S)

    run(main())
