"""A disaggregated hand-off through both node servers, driven by a test client playing the
router, gives the tokens of local prefill on the decode node and of the offline engine."""

from __future__ import annotations

import asyncio

import pytest

from engine import LLM, SamplingParams
from pdserve.v1 import node_pb2
from tests.unit.decode_node.node_harness import (
    BLOCK_SIZE,
    GREEDY,
    MODEL,
    NUM_BLOCKS,
    TRANSPORTS,
    engine_config,
    prompt,
    run,
    run_disaggregated,
    run_local,
    running_nodes,
)

pytestmark = pytest.mark.timeout(120)


def engine_tokens(prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    llm = LLM(MODEL, device="cpu", dtype="float32", block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)
    return [out.token_ids for out in llm.generate(prompts, params)]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_handoff_matches_local_prefill_and_engine(transport: str) -> None:
    prompt_ids = prompt(37, seed=1)
    (expected,) = engine_tokens(
        [prompt_ids], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, seed=7)
    )

    async def main() -> None:
        async with running_nodes(transport) as nodes:
            handoff = await run_disaggregated(nodes, "disagg", prompt_ids)
            local = await run_local(nodes, "local", prompt_ids)

            assert handoff.token_ids == expected
            assert local == expected
            assert handoff.first_token.token_id == expected[0]
            assert handoff.chunks[-1].finish_reason == "length"
            result = handoff.transfer_result
            assert result.ok and result.error == ""
            layout = nodes.decode.layout
            num_blocks = layout.num_blocks_for(len(prompt_ids))
            assert result.num_bytes == layout.num_layers * layout.layer_bytes(num_blocks)
            assert len(handoff.ticket.dst_block_ids) == -(-(len(prompt_ids) + 1) // BLOCK_SIZE)

            decode_trace = nodes.decode.traces["disagg"]
            assert not decode_trace.prefilled_locally
            assert sorted(decode_trace.layer_arrived_s) == list(range(layout.num_layers))
            assert len(decode_trace.token_times_s) == len(expected)
            assert nodes.decode.traces["local"].prefilled_locally
            prefill_trace = nodes.prefill.traces[handoff.ticket.transfer_id]
            for computed_s, sent_s in zip(
                prefill_trace.layer_computed_s, prefill_trace.layer_sent_s
            ):
                assert computed_s is not None and sent_s is not None and computed_s <= sent_s

            prefill_stats, decode_stats = await nodes.stats()
            assert prefill_stats.num_finished_requests == 1
            assert prefill_stats.num_failed_transfers == 0
            assert decode_stats.num_finished_requests == 2
            assert decode_stats.num_local_prefills == 1  # the LOCAL_PREFILL request only
            assert decode_stats.num_failed_transfers == 0

    run(main())


def test_concurrent_handoffs_chunked_seeded_with_logprobs() -> None:
    """Three requests at once; the prefill node chunks the prompts (16-token budget), samples
    with a seed, and returns logprobs: every token and logprob matches the offline engine."""
    prompts = [prompt(length, seed=10 + length) for length in (30, 45, 9)]
    sampling = node_pb2.NodeSamplingParams(
        max_tokens=10, temperature=0.8, seed=1234, logprobs=2, ignore_eos=True
    )
    llm = LLM(MODEL, device="cpu", dtype="float32", block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)
    expected = llm.generate(
        prompts,
        SamplingParams(max_tokens=10, temperature=0.8, seed=1234, logprobs=2, ignore_eos=True),
    )

    async def main() -> None:
        prefill_engine = engine_config(prefill_only=True, max_num_batched_tokens=16)
        async with running_nodes("tcp", prefill_engine=prefill_engine) as nodes:
            handoffs = await asyncio.gather(
                *(
                    run_disaggregated(nodes, f"r{i}", prompt_ids, sampling)
                    for i, prompt_ids in enumerate(prompts)
                )
            )
            for handoff, want in zip(handoffs, expected):
                assert handoff.transfer_result.ok
                assert handoff.token_ids == want.token_ids
                logprobs = [lp for chunk in handoff.chunks for lp in chunk.logprobs]
                assert [lp.token_id for lp in logprobs] == want.token_ids
                assert [len(lp.top) for lp in logprobs] == [2] * len(want.token_ids)
                assert logprobs[0].logprob == pytest.approx(want.logprobs[0].logprob, abs=1e-4)
                assert handoff.first_token.logprob.token_id == want.token_ids[0]
            _, decode_stats = await nodes.stats()
            assert decode_stats.num_local_prefills == 0

    run(main())


def test_first_token_that_finishes_the_request() -> None:
    """max_tokens=1: the prefill node's token ends the request; the KV still goes over and
    the decode node streams that one token with finish_reason "length"."""
    prompt_ids = prompt(11, seed=3)
    sampling = node_pb2.NodeSamplingParams(max_tokens=1, temperature=0.0, seed=1)

    async def main() -> None:
        async with running_nodes("local") as nodes:
            handoff = await run_disaggregated(nodes, "one", prompt_ids, sampling)
            assert handoff.first_token.finish_reason == "length"
            assert handoff.transfer_result.ok
            assert handoff.token_ids == [handoff.first_token.token_id]
            assert handoff.chunks[-1].finish_reason == "length"

    run(main())


def test_local_prefill_stream_shape() -> None:
    """LOCAL_PREFILL: no ticket; chunks from output index 0, the last with finish_reason and
    the prompt's prefix-cache hits (a second identical prompt hits every full block but the
    one holding its last token)."""
    prompt_ids = prompt(21, seed=4)

    async def main() -> None:
        async with running_nodes("local") as nodes:
            first = await run_local(nodes, "a", prompt_ids, GREEDY)
            call = nodes.decode_stub.Decode(
                node_pb2.DecodeRequest(
                    request_id="b",
                    prompt_token_ids=prompt_ids,
                    sampling=GREEDY,
                    mode=node_pb2.DECODE_MODE_LOCAL_PREFILL,
                )
            )
            messages = [message async for message in call]
            assert all(m.WhichOneof("kind") == "tokens" for m in messages)
            chunks = [m.tokens for m in messages]
            assert [t for c in chunks for t in c.token_ids] == first
            assert chunks[-1].num_cached_tokens == (len(prompt_ids) - 1) // BLOCK_SIZE * BLOCK_SIZE
            _, decode_stats = await nodes.stats()
            assert decode_stats.num_prefix_cache_hit_tokens == chunks[-1].num_cached_tokens

    run(main())


def test_prefix_cache_hit_on_the_prefill_node_still_sends_the_whole_prompt() -> None:
    """The second identical prompt finds all its full blocks but the last in the prefill
    node's prefix cache and computes only the rest; the KV sent must still cover the whole
    prompt, so the tokens are the same."""
    prompt_ids = prompt(29, seed=12)

    async def main() -> None:
        async with running_nodes("local") as nodes:
            cold = await run_disaggregated(nodes, "cold", prompt_ids)
            warm = await run_disaggregated(nodes, "warm", prompt_ids)
            assert cold.first_token.num_cached_tokens == 0
            assert warm.first_token.num_cached_tokens == 28  # 7 full blocks of 4
            assert warm.transfer_result.num_bytes == cold.transfer_result.num_bytes
            assert warm.token_ids == cold.token_ids
            prefill_stats, _ = await nodes.stats()
            assert prefill_stats.num_prefix_cache_hit_tokens == 28

    run(main())
