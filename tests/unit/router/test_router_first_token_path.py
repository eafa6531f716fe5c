"""Issue 40: the first token's path through the router. P's first token reaches the client the
moment it comes, whatever D's ticket and P's AttachTicket are doing; a traced request
(`pdserve-trace` metadata) gets its milestones back, an untraced one records none."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest
from router_fakes import TEST_TIMEOUT_S, RouterHarness, run

from router.client import build_request
from router.request_record import RequestRecord
from tests.waiting import wait_until

TEXT = "héllo wörld 日本語 🙂 naïve café"


@pytest.fixture(scope="module")
def output_ids(tokenizer) -> list[int]:
    return tokenizer.encode(TEXT, add_special_tokens=False)


def test_the_first_token_reaches_the_client_before_the_decode_node_sends_its_ticket(
    tokenizer_files, output_ids
) -> None:
    async def body():
        async with RouterHarness(tokenizer_files, output_ids) as h:
            h.prefill[0].first_before_ticket = True
            h.decode[0].ticket_gate.clear()  # D reserves, but holds its ticket
            stream = h.client.generate("hello", max_tokens=4)
            first = await asyncio.wait_for(anext(stream), TEST_TIMEOUT_S)
            attached_before_ticket = list(h.prefill[0].attached)
            h.decode[0].ticket_gate.set()
            rest = [c async for c in stream]
            return first, rest, attached_before_ticket, h

    first, rest, attached_before_ticket, h = run(body())

    assert list(first.token_ids) == output_ids[:1]
    assert attached_before_ticket == []  # it came while D still held the ticket
    assert [t for c in rest for t in c.token_ids] == output_ids[1:4]
    assert rest[-1].finish_reason == "length"
    assert len(h.prefill[0].attached) == 1 and h.router.stats.num_prefill_failures == 0


def test_a_failed_attach_after_the_first_token_cancels_the_transfer(
    tokenizer_files, output_ids
) -> None:
    """P's first token went out before its ticket; its AttachTicket then fails: the prefill
    counts as failed, D is told to prefill locally, and the client's output is complete."""

    async def body():
        async with RouterHarness(tokenizer_files, output_ids) as h:
            h.prefill[0].first_before_ticket = True
            h.prefill[0].attach_fail_code = grpc.StatusCode.INTERNAL
            result = await h.client.generate_all("hello", max_tokens=5, timeout_s=TEST_TIMEOUT_S)
            await wait_until(lambda: h.prefill[0].cancelled, TEST_TIMEOUT_S)
            return result, h

    result, h = run(body())

    assert result.token_ids == output_ids[:5] and result.finish_reason == "length"
    assert h.router.stats.num_prefill_failures == 1
    (cancelled,) = h.decode[0].cancelled_transfers
    assert cancelled == h.prefill[0].attached[0].ticket.transfer_id


def test_a_traced_request_gets_its_milestones_and_an_untraced_one_none(
    tokenizer_files, output_ids, caplog
) -> None:
    async def body():
        async with RouterHarness(tokenizer_files, output_ids) as h:
            traced: dict[str, float] = {}
            request = build_request("hello", max_tokens=3)
            chunks = [c async for c in h.client.stream(request, TEST_TIMEOUT_S, trace=traced)]
            untraced: dict[str, float] = {}
            call = h.client._stub.Generate(build_request("hello", max_tokens=3))
            async for _ in call:
                pass
            untraced.update((k, 0.0) for k, _ in await call.trailing_metadata() or ())
            return chunks, traced, untraced

    with caplog.at_level(logging.INFO, logger="router.access"):
        chunks, traced, untraced = run(body())

    assert chunks[-1].finish_reason == "length"
    order = ["received", "processed", "routed", "decode_sent", "prefill_sent", "ticket",
             "attached"]  # fmt: skip
    assert [traced[name] for name in order] == sorted(traced[name] for name in order)
    # index 0 goes out from whichever stream had it first (the fake D may beat the fake P)
    first_in = min(traced["prefill_first_token"], traced["decode_first_token"])
    assert traced["routed"] < first_in <= traced["first_token_out"]
    assert "pdserve-trace" not in untraced
    lines = [r.getMessage() for r in caplog.records if r.name == "router.access"]
    assert len(lines) == 2 and "spans=received:0.000," in lines[0] and "spans" not in lines[1]


def test_spans_are_milestones_in_time_order_after_arrival() -> None:
    record = RequestRecord("r", "grpc", start_s=10.0, marks={"received": 10.0})
    record.marks["routed"] = 10.002
    record.marks["processed"] = 10.001
    record.tokens_sent(1, 10.005)

    assert record.spans() == "received:0.000,processed:1.000,routed:2.000,first_token_out:5.000"
    assert RequestRecord("r", "grpc").access_line().count("spans") == 0


def test_the_decode_nodes_index_0_waits_for_the_first_token_carrying_prompt_logprobs(
    tokenizer_files, output_ids
) -> None:
    """With prompt logprobs asked for, D's whole stream is in before P writes its first token
    (which carries them): the client's first response is still the one with the prompt
    logprobs, and the output is complete."""

    async def body():
        async with RouterHarness(tokenizer_files, output_ids, chunk_size=3) as h:
            h.prefill[0].first_token_gate.clear()

            async def release_after_decode() -> None:
                await wait_until(lambda: 3 in h.decode[0].chunks_sent, TEST_TIMEOUT_S)
                h.prefill[0].first_token_gate.set()

            release = asyncio.create_task(release_after_decode())
            request = build_request("hello world", max_tokens=4, prompt_logprobs=1)
            chunks = [c async for c in h.client.stream(request, TEST_TIMEOUT_S)]
            await release
            return chunks, h

    chunks, h = run(body())

    prompt_ids = list(h.decode[0].requests[0].prompt_token_ids)
    assert [lp.token_id for lp in chunks[0].prompt_logprobs] == prompt_ids[1:]
    assert all(not c.prompt_logprobs for c in chunks[1:])
    assert [t for c in chunks for t in c.token_ids] == output_ids[:4]
