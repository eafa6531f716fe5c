"""Suffix-only hand-offs with an FP8 KV cache (issues 38 and 40): the prefix the decode node
holds and the suffix the prefill node sends are the same dtype and layout, or the hand-off is
refused. Both nodes FP8: only the new blocks travel, at FP8's size, and the tokens are a cold
FP8 engine's. An FP8 decode node's suffix ticket at a float32 prefill node: refused naming both
dtypes; the decode node falls back to a local prefill that reuses its own FP8 prefix."""

from __future__ import annotations

import dataclasses

import grpc
import pytest

from engine import LLM, SamplingParams
from pdserve.engine_config import EngineConfig
from pdserve.v1 import node_pb2
from tests.unit.decode_node.node_harness import (
    BLOCK_SIZE,
    GREEDY,
    MODEL,
    RPC_TIMEOUT_S,
    engine_config,
    open_second_turn,
    prompt,
    read_chunks,
    run,
    run_disaggregated,
    run_local,
    running_nodes,
    tokens_of,
)

pytestmark = pytest.mark.timeout(180)

FP8 = "fp8_e4m3"
TURN_1 = prompt(23, seed=31)
NEW_TOKENS = prompt(9, seed=32)


def fp8_engine(prefill_only: bool) -> EngineConfig:
    config = engine_config(prefill_only=prefill_only)
    cache = dataclasses.replace(config.cache, kv_cache_dtype=FP8)
    return dataclasses.replace(config, cache=cache)


def cold_fp8_tokens(prompt_ids: list[int]) -> list[int]:
    """Greedy tokens of an FP8 engine with prefix caching off (nothing reused)."""
    llm = LLM(MODEL, device="cpu", dtype="float32", block_size=BLOCK_SIZE, num_blocks=64,
              enable_prefix_caching=False, kv_cache_dtype=FP8)  # fmt: skip
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, seed=7)
    return llm.generate([prompt_ids], params)[0].token_ids


def test_an_fp8_second_turn_sends_only_its_new_fp8_blocks() -> None:
    async def main() -> None:
        async with running_nodes(
            "tcp", prefill_engine=fp8_engine(True), decode_engine=fp8_engine(False)
        ) as nodes:
            layout = nodes.decode.layout
            assert layout.dtype == nodes.prefill.layout.dtype == FP8
            answer = await run_local(nodes, "turn-1", TURN_1)  # D holds turn 1, in FP8
            turn_2 = TURN_1 + answer + NEW_TOKENS
            second = await run_disaggregated(nodes, "turn-2", turn_2)
            assert second.transfer_result.ok, second.transfer_result.error
            num_cached = (len(TURN_1) + len(answer) - 1) // BLOCK_SIZE
            assert second.ticket.num_cached_blocks == num_cached
            assert second.ticket.kv_cache_dtype == FP8
            num_sent = -(-len(turn_2) // BLOCK_SIZE) - num_cached
            # one byte per value: a quarter of the float32 model's
            assert layout.bytes_per_block == 2 * BLOCK_SIZE * layout.num_kv_heads * layout.head_dim
            assert second.transfer_result.num_bytes == layout.kv_bytes(num_sent)
            assert second.token_ids == cold_fp8_tokens(turn_2)

    run(main())


def test_an_fp8_suffix_ticket_at_a_float32_prefill_node_is_refused() -> None:
    async def main() -> None:
        async with running_nodes("tcp", decode_engine=fp8_engine(False)) as nodes:
            assert nodes.prefill.layout.dtype == "float32"
            second = await open_second_turn(nodes, TURN_1, NEW_TOKENS)
            turn_2, call, ticket = second.prompt, second.call, second.ticket
            assert ticket.num_cached_blocks > 0
            prefill = nodes.prefill_stub.Prefill(
                node_pb2.PrefillRequest(request_id="turn-2", prompt_token_ids=turn_2,
                                        sampling=GREEDY, ticket=ticket),
                timeout=RPC_TIMEOUT_S,
            )  # fmt: skip
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await prefill.read()
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert f"kv cache dtype float32 vs {FP8}" in (refused.value.details() or "")
            # the router cancels the hand-off: D prefills locally on its own FP8 prefix
            cancel = node_pb2.CancelTransferRequest(transfer_id=ticket.transfer_id, reason="test")
            assert (await nodes.decode_stub.CancelTransfer(cancel, timeout=RPC_TIMEOUT_S)).found
            chunks = await read_chunks(call)
            assert chunks[-1].num_cached_tokens == ticket.num_cached_blocks * BLOCK_SIZE
            assert tokens_of(chunks) == cold_fp8_tokens(turn_2)

    run(main())
