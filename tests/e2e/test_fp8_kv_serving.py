"""FP8 KV cache end to end: a 1P1D cluster over tcp with `--kv-cache-dtype fp8_e4m3` on both
nodes gives the tokens of a colocated FP8 cluster and of the offline FP8 engine (the FP8 blocks
cross the wire byte for byte), every request through the prefill node, no block leaked."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.v1 import node_pb2
from router.client import GenerationClient, GenerationResult
from tests.e2e.cluster import Cluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MODEL = "smollm2-135m"
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Five facts about octopuses:\n1.",
    "Once upon a time, in a small village,",
]
MAX_TOKENS = 16
FP8_ARGS = ["--model", MODEL, "--device", "cpu", "--dtype", "float32",
            "--kv-cache-dtype", "fp8_e4m3", "--kv-transport", "tcp"]  # fmt: skip


def _greedy(address: str) -> list[GenerationResult]:
    async def main() -> list[GenerationResult]:
        async with GenerationClient(address) as client:
            return await asyncio.gather(
                *(client.generate_all(p, timeout_s=120, temperature=0.0, max_tokens=MAX_TOKENS)
                  for p in PROMPTS)
            )  # fmt: skip

    return asyncio.run(asyncio.wait_for(main(), 300))


def _serve(*args: str) -> tuple[list[list[int]], dict[str, node_pb2.NodeStats]]:
    """The greedy tokens of PROMPTS on a fresh cluster, and its nodes' stats once drained."""
    cluster = Cluster([*FP8_ARGS, *args]).start()
    try:
        tokens = [r.token_ids for r in _greedy(cluster.router)]
        stats = cluster.wait_all_blocks_free(timeout_s=5)
        assert all(s.num_free_kv_blocks == s.num_kv_blocks for s in stats.values()), stats
        return tokens, stats
    finally:
        leftover = cluster.stop()
        assert not leftover, f"processes left behind after Ctrl-C: {leftover}"


def test_1p1d_equals_colocated_with_fp8_kv_on_both_sides() -> None:
    from engine import LLM, SamplingParams

    llm = LLM(MODEL, device="cpu", dtype="float32", kv_cache_dtype="fp8_e4m3")
    offline = [o.token_ids for o in llm.generate(
        PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))]  # fmt: skip
    del llm

    disaggregated, pd_stats = _serve("--prefill", "1", "--decode", "1")
    colocated, _ = _serve("--prefill", "0", "--decode", "1")

    assert disaggregated == colocated == offline
    # every request's FP8 KV crossed from the prefill node: none fell back to a local prefill
    assert pd_stats["prefill-0"].num_finished_requests >= len(PROMPTS)
    decode = pd_stats["decode-0"]
    assert decode.num_local_prefills == 0 and decode.num_failed_transfers == 0
