"""Generate end to end through a real RouterServer over fake nodes: the dispatch protocol (when
something fails: test_router_generate_failures.py)."""

from __future__ import annotations

import asyncio

import pytest
from router_fakes import TEST_TIMEOUT_S, RouterHarness, run

from pdserve.structured_output import StructuredOutputParams
from pdserve.v1 import node_pb2
from router.client import build_request
from tests.waiting import wait_until

WAIT_S = 10.0  # what the router's cancellations get to reach the fake nodes

TEXT = "héllo wörld 日本語 🙂 naïve café"


@pytest.fixture(scope="module")
def output_ids(tokenizer) -> list[int]:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert len(ids) >= 8
    return ids


def test_disaggregated_stream_is_complete_and_decodes_to_the_text(
    tokenizer_files, tokenizer, output_ids
) -> None:
    async def body():
        async with RouterHarness(tokenizer_files, output_ids, chunk_size=3) as h:
            chunks = [c async for c in h.client.generate("hello world", max_tokens=len(output_ids))]
            return chunks, h

    chunks, h = run(body())

    token_ids = [t for c in chunks for t in c.token_ids]
    assert token_ids == output_ids  # index 0 came from both P and D: emitted once
    assert "".join(c.text for c in chunks) == tokenizer.decode(output_ids) == TEXT
    assert [c.finish_reason for c in chunks[:-1]] == [""] * (len(chunks) - 1)
    last = chunks[-1]
    assert last.finish_reason == "length"
    assert last.usage.prompt_tokens == len(tokenizer.encode("hello world"))
    assert last.usage.completion_tokens == len(output_ids)
    assert len({c.request_id for c in chunks}) == 1 and len(chunks[0].request_id) == 32
    (decode_request,) = h.decode[0].requests
    (prefill_request,) = h.prefill[0].requests
    assert decode_request.mode == node_pb2.DECODE_MODE_DISAGGREGATED
    assert not prefill_request.HasField("ticket")  # P started before D's ticket was in
    (attached,) = h.prefill[0].attached
    assert attached.ticket.num_tokens == len(decode_request.prompt_token_ids)
    assert attached.request_id == prefill_request.request_id
    assert prefill_request.request_id == decode_request.request_id == chunks[0].request_id
    assert h.router.stats.finish_reasons == {"length": 1}


def test_first_token_is_emitted_before_the_decode_node_streams(tokenizer_files, output_ids) -> None:
    async def body():
        async with RouterHarness(tokenizer_files, output_ids) as h:
            h.decode[0].gate.clear()  # D holds every chunk
            stream = h.client.generate("hello", max_tokens=6)
            first = await asyncio.wait_for(anext(stream), TEST_TIMEOUT_S)
            h.decode[0].gate.set()
            rest = [c async for c in stream]
            return first, rest

    first, rest = run(body())

    assert list(first.token_ids) == output_ids[:1]
    assert [t for c in rest for t in c.token_ids] == output_ids[1:6]
    assert rest[-1].finish_reason == "length"


def test_the_prefill_starts_before_the_decode_node_has_sent_its_ticket(
    tokenizer_files, output_ids
) -> None:
    """The router calls P at once, beside D: D's reservation round trip hides behind P's
    forward; the ticket follows in AttachTicket."""

    async def body():
        async with RouterHarness(tokenizer_files, output_ids) as h:
            h.decode[0].ticket_gate.clear()  # D reserves, but holds its ticket
            task = asyncio.create_task(h.client.generate_all("hello", max_tokens=4))
            await wait_until(lambda: h.prefill[0].requests, TEST_TIMEOUT_S)
            attached_before_ticket = list(h.prefill[0].attached)
            h.decode[0].ticket_gate.set()
            return await asyncio.wait_for(task, TEST_TIMEOUT_S), attached_before_ticket, h

    result, attached_before_ticket, h = run(body())

    assert result.token_ids == output_ids[:4] and result.finish_reason == "length"
    assert attached_before_ticket == []  # P was called while D still held the ticket
    (attached,) = h.prefill[0].attached
    assert not h.decode[0].cancelled_transfers and h.router.stats.num_prefill_failures == 0


def test_colocated_mode_sends_local_prefill(tokenizer_files, output_ids) -> None:
    async def body():
        async with RouterHarness(tokenizer_files, output_ids, num_prefill=0) as h:
            result = await h.client.generate_all("hello", max_tokens=3)
            return result, h

    result, h = run(body())

    assert result.token_ids == output_ids[:3]
    (request,) = h.decode[0].requests
    assert request.mode == node_pb2.DECODE_MODE_LOCAL_PREFILL


def test_round_robin_spreads_requests_over_two_prefill_and_two_decode_nodes(
    tokenizer_files, output_ids
) -> None:
    async def body():
        async with RouterHarness(tokenizer_files, output_ids, num_prefill=2, num_decode=2) as h:
            results = await asyncio.gather(
                *(h.client.generate_all("hello", max_tokens=3) for _ in range(4))
            )
            return results, h

    results, h = run(body())

    assert all(r.token_ids == output_ids[:3] for r in results)
    assert [len(n.requests) for n in (*h.prefill, *h.decode)] == [2, 2, 2, 2]


def test_stop_string_ends_the_stream_and_aborts_the_decode_node(tokenizer_files, tokenizer) -> None:
    output_ids = tokenizer.encode("hello world, hello there! the end", add_special_tokens=False)

    async def body():
        async with RouterHarness(tokenizer_files, output_ids) as h:
            h.decode[0].hold_at = len(output_ids) - 2  # D never sends its last chunk
            h.decode[0].gate.clear()
            result = await h.client.generate_all("hi", max_tokens=len(output_ids), stop=["there"])
            await wait_until(lambda: h.decode[0].aborted and h.decode[0].cancelled, WAIT_S)
            return result, h

    result, h = run(body())

    assert result.finish_reason == "stop"
    assert result.text == "hello world, hello "
    # The token that completed "there" is the last one; the later ones are dropped.
    assert tokenizer.decode(result.token_ids).startswith("hello world, hello there")
    assert not tokenizer.decode(result.token_ids[:-1]).startswith("hello world, hello there")
    assert result.usage.completion_tokens == len(result.token_ids) < len(output_ids)
    request_id = result.request_id
    assert h.decode[0].aborted == [request_id] and h.decode[0].cancelled == [request_id]


def test_first_token_that_finishes_the_request_aborts_the_decode_node(
    tokenizer_files, output_ids
) -> None:
    async def body():
        async with RouterHarness(tokenizer_files, output_ids) as h:
            h.decode[0].gate.clear()
            result = await h.client.generate_all("hello", max_tokens=1)
            await wait_until(lambda: h.decode[0].aborted, WAIT_S)
            return result, h

    result, h = run(body())

    assert result.token_ids == output_ids[:1] and result.finish_reason == "length"
    assert h.decode[0].aborted == [result.request_id]
    assert h.decode[0].cancelled == [result.request_id]


def test_client_cancel_cancels_both_node_calls(tokenizer_files, output_ids) -> None:
    async def body():
        async with RouterHarness(tokenizer_files, output_ids) as h:
            for node in (h.prefill[0], h.decode[0]):
                node.gate.clear()  # P holds its transfer result, D its chunks
            stream = h.client.generate("hello", max_tokens=6)
            first = await asyncio.wait_for(anext(stream), TEST_TIMEOUT_S)
            await stream.aclose()  # cancels the call
            await wait_until(
                lambda: h.prefill[0].cancelled and h.decode[0].cancelled and h.decode[0].aborted,
                WAIT_S,
            )
            return first, h

    first, h = run(body())

    assert h.prefill[0].cancelled == [first.request_id]
    assert h.decode[0].cancelled == [first.request_id]
    # and an Abort, in case grpc lost the cancellation (it can, just after a call starts)
    assert h.decode[0].aborted == [first.request_id]
    assert h.router.stats.num_cancelled == 1


def test_logprobs_and_cached_tokens_pass_through(tokenizer_files, output_ids) -> None:
    async def body():
        async with RouterHarness(tokenizer_files, output_ids) as h:
            h.model.num_cached_tokens = 3
            return await h.client.generate_all("hello", max_tokens=4, logprobs=1)

    result = run(body())

    assert [lp.token_id for lp in result.logprobs] == output_ids[:4]
    assert [lp.logprob for lp in result.logprobs] == [-0.25, -0.5, -0.75, -1.0]
    assert result.usage.cached_tokens == 3


def test_no_logprobs_unless_requested(tokenizer_files, output_ids) -> None:
    async def body():
        async with RouterHarness(tokenizer_files, output_ids) as h:
            return await h.client.generate_all("hello", max_tokens=4)

    assert run(body()).logprobs == []


def test_get_model_info_comes_from_the_nodes(tokenizer_files, output_ids) -> None:
    async def body():
        async with RouterHarness(tokenizer_files, output_ids) as h:
            return await h.client.model_info(timeout_s=5)

    info = run(body())

    assert (info.model_name, info.max_model_len, info.vocab_size) == ("fake-model", 64, 320)
    assert list(info.eos_token_ids) == [2]


def test_prompt_logprobs_and_a_structured_output_over_grpc(tokenizer_files, output_ids) -> None:
    """The GenerateRequest's structured_output, prompt_logprobs and logit_bias reach both
    nodes; P's prompt logprobs come out on the first chunk although D's index 0 (the same
    token, delivered before P writes it) may arrive first."""
    spec = StructuredOutputParams.json_schema({"type": "object"})

    async def body():
        async with RouterHarness(tokenizer_files, output_ids, chunk_size=3) as h:
            request = build_request("hello world", max_tokens=4, prompt_logprobs=1,
                                    logit_bias={5: -1.5})  # fmt: skip
            request.sampling.structured_output.CopyFrom(spec.to_proto())
            chunks = [c async for c in h.client.stream(request)]
            return chunks, h

    chunks, h = run(body())
    (decode_request,) = h.decode[0].requests
    (prefill_request,) = h.prefill[0].requests
    for node_request in (decode_request, prefill_request):
        sampling = node_request.sampling
        assert StructuredOutputParams.from_proto(sampling.structured_output) == spec
        assert sampling.prompt_logprobs == 1 and dict(sampling.logit_bias) == {5: -1.5}
    prompt_ids = list(decode_request.prompt_token_ids)
    assert [lp.token_id for lp in chunks[0].prompt_logprobs] == prompt_ids[1:]
    assert all(not c.prompt_logprobs for c in chunks[1:])
    assert [t for c in chunks for t in c.token_ids] == output_ids[:4]
