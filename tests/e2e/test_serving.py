"""Disaggregated serving end to end: real pd-serve clusters (router + node processes) on
loopback with the real default model, checked against colocated serving and the offline engine."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from router.client import GenerationClient, GenerationResult
from tests.e2e.conftest import REAL_MODEL_CLUSTERS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), REAL_MODEL_CLUSTERS]

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Five facts about octopuses:\n1.",
    "Once upon a time, in a small village,",
    "The three laws of thermodynamics are",
    "Translate to German: Good morning, how are you?",
    "A haiku about the sea:",
    "The best way to learn a programming language is",
]
MAX_TOKENS = 24


def generate_many(address: str, prompts: list[str], **sampling) -> list[GenerationResult]:
    async def main():
        async with GenerationClient(address) as client:
            return await asyncio.gather(
                *(client.generate_all(p, timeout_s=120, **sampling) for p in prompts)
            )

    return asyncio.run(asyncio.wait_for(main(), 300))


@pytest.fixture(scope="module")
def offline_reference():
    from engine import LLM, SamplingParams

    llm = LLM("smollm2-135m", device="cpu", dtype="float32")
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    return [o.token_ids for o in outs], llm.tokenizer


def greedy(address: str) -> list[GenerationResult]:
    return generate_many(address, PROMPTS, temperature=0.0, max_tokens=MAX_TOKENS)


def test_2p2d_spreads_requests_and_matches(cluster_2p2d, offline_reference):
    # First in the module: its 4 nodes start and stop before cluster_1p1d's 2 start.
    expected, _ = offline_reference
    results = greedy(cluster_2p2d.router)
    assert [r.token_ids for r in results] == expected
    for name in ("prefill-0", "prefill-1", "decode-0", "decode-1"):
        assert cluster_2p2d.node_stats(name).num_finished_requests >= 2, name
    stats = cluster_2p2d.wait_all_blocks_free(timeout_s=5)
    assert all(s.num_free_kv_blocks == s.num_kv_blocks for s in stats.values()), stats


def test_1p1d_equals_colocated_and_offline(cluster_1p1d, cluster_colocated, offline_reference):
    expected, tokenizer = offline_reference
    disaggregated = greedy(cluster_1p1d.router)
    colocated = greedy(cluster_colocated.router)
    assert [r.token_ids for r in disaggregated] == expected
    assert [r.token_ids for r in colocated] == expected
    for result in disaggregated:
        assert result.finish_reason in ("stop", "length")
        assert result.text == tokenizer.decode(result.token_ids)
        assert result.usage.completion_tokens == len(result.token_ids)
    # every request of the 1P1D cluster went through the prefill node, none fell back
    decode_stats = cluster_1p1d.node_stats("decode-0")
    assert cluster_1p1d.node_stats("prefill-0").num_finished_requests >= len(PROMPTS)
    assert decode_stats.num_local_prefills == 0 and decode_stats.num_failed_transfers == 0
    assert cluster_colocated.node_stats("decode-0").num_local_prefills >= len(PROMPTS)
    for cluster in (cluster_1p1d, cluster_colocated):
        stats = cluster.wait_all_blocks_free(timeout_s=5)
        assert all(s.num_free_kv_blocks == s.num_kv_blocks for s in stats.values()), stats


def test_streaming_chunks_text_and_stop_string(cluster_1p1d, offline_reference):
    _, tokenizer = offline_reference

    async def main():
        async with GenerationClient(cluster_1p1d.router) as client:
            arrivals, chunks = [], []
            async for chunk in client.generate(
                "Count: one, two, three, four,",
                temperature=0.0,
                max_tokens=40,
                ignore_eos=True,
                timeout_s=120,
            ):
                arrivals.append(time.monotonic())
                chunks.append(chunk)
            stopped = await client.generate_all(
                "Count: one, two, three, four,",
                temperature=0.0,
                max_tokens=40,
                stop=[" seven"],
                timeout_s=120,
            )
            return arrivals, chunks, stopped

    arrivals, chunks, stopped = asyncio.run(asyncio.wait_for(main(), 300))
    assert len(chunks) > 5 and arrivals[0] < arrivals[-1]
    assert [c.finish_reason for c in chunks[:-1]] == [""] * (len(chunks) - 1)
    assert chunks[-1].finish_reason == "length"
    token_ids = [t for c in chunks for t in c.token_ids]
    assert len(token_ids) == 40
    full_text = "".join(c.text for c in chunks)
    assert full_text == tokenizer.decode(token_ids)
    assert " seven" in full_text, "the greedy continuation should count on past seven"
    assert stopped.finish_reason == "stop"
    assert stopped.text == full_text[: full_text.index(" seven")]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(prompt=""), "empty"),
        (dict(prompt="hi " * 9000, max_tokens=16), "context"),
        (dict(prompt="hello", max_tokens=0), "max_tokens"),
        (dict(prompt="hello", temperature=-1.0), "temperature"),
        (dict(messages=[{"role": "wizard", "content": "hi"}]), "role"),
    ],
    ids=["empty", "too-long", "max-tokens-0", "temperature", "chat-role"],
)
def test_bad_input_is_invalid_argument(cluster_1p1d, kwargs, message):
    async def main():
        async with GenerationClient(cluster_1p1d.router) as client:
            prompt = kwargs.pop("prompt", None)
            return await client.generate_all(prompt, timeout_s=60, **kwargs)

    with pytest.raises(grpc.aio.AioRpcError) as error:
        asyncio.run(asyncio.wait_for(main(), 120))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in error.value.details().lower()
    stats = cluster_1p1d.wait_all_blocks_free(timeout_s=2)
    assert all(s.num_free_kv_blocks == s.num_kv_blocks for s in stats.values()), stats


def cancel_mid_stream(cluster) -> float:
    """Stream a long greedy request, leave after 5 tokens (the decode node holding blocks for
    it then), which cancels the call; when it was cancelled (time.monotonic())."""

    async def main():
        async with GenerationClient(cluster.router) as client:
            seen = 0
            async for chunk in client.generate(
                "Write a very long story.",
                temperature=0.0,
                max_tokens=1000,
                ignore_eos=True,
                timeout_s=120,
            ):
                seen += len(chunk.token_ids)
                if seen >= 5:
                    busy = cluster.node_stats("decode-0")
                    assert busy.num_free_kv_blocks < busy.num_kv_blocks
                    break  # leaving the stream cancels the call
            return time.monotonic()

    return asyncio.run(asyncio.wait_for(main(), 120))


def test_cancel_mid_stream_frees_decode_blocks_within_a_second(cluster_1p1d):
    cancelled_at = cancel_mid_stream(cluster_1p1d)
    stats = cluster_1p1d.wait_all_blocks_free(timeout_s=1.0)
    freed_after_s = time.monotonic() - cancelled_at
    decode = stats["decode-0"]
    assert decode.num_free_kv_blocks == decode.num_kv_blocks, (decode, freed_after_s)


def test_a_request_ending_on_its_first_token_logs_no_warning(cluster_1p1d):
    """Issue 34: max_tokens=1, or a first token that stops the request (here a stop token id,
    as an EOS would): the hand-off is cancelled quietly (DEBUG), and no process of the cluster
    logs a WARNING or ERROR about it; nothing falls back, nothing leaks."""
    prompts = PROMPTS[:3]
    router = cluster_1p1d.router
    first = [r.token_ids[0] for r in generate_many(router, prompts, temperature=0.0, max_tokens=1)]
    local_prefills_before = cluster_1p1d.node_stats("decode-0").num_local_prefills
    mark = cluster_1p1d.num_log_lines

    async def main():
        async with GenerationClient(router) as client:
            ones = [client.generate_all(p, temperature=0.0, max_tokens=1, timeout_s=120)
                    for p in prompts]  # fmt: skip
            stops = [
                client.generate_all(p, temperature=0.0, max_tokens=16, stop_token_ids=[token],
                                    timeout_s=120)
                for p, token in zip(prompts, first, strict=True)
            ]  # fmt: skip
            return await asyncio.gather(*ones, *stops)

    results = asyncio.run(asyncio.wait_for(main(), 300))
    assert [r.finish_reason for r in results] == ["length"] * 3 + ["stop"] * 3
    stats = cluster_1p1d.wait_all_blocks_free(timeout_s=10)
    assert all(s.num_free_kv_blocks == s.num_kv_blocks for s in stats.values()), stats
    assert all(s.num_pending_transfers == 0 for s in stats.values()), stats
    time.sleep(1.0)  # a late message (a result, an ack) would be logged by now
    assert stats["decode-0"].num_local_prefills == local_prefills_before  # none fell back
    noisy = [
        line
        for line in cluster_1p1d.log_since(mark)
        if " WARNING " in line or " ERROR " in line or "Traceback" in line
    ]
    assert not noisy, "".join(noisy)
