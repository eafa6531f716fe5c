"""Speculative decoding over an FP8 KV cache (--kv-cache-dtype fp8_e4m3): the verify step's
K + 1 queries write and read the target's FP8 blocks through the same quantized write and
dequantized gather as a plain decode, so greedy and seeded requests give the tokens of the
FP8 engine without speculation; a draft model keeps its own KV in the model's dtype beside
the target's FP8 pool, sized into the same budget."""

from __future__ import annotations

import pytest
import torch

from engine import LLM
from tests.unit.engine.spec_decode.test_spec_engine import proposers, run, workload

FP8 = {"kv_cache_dtype": "fp8_e4m3", "num_blocks": 256}


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoints) -> str:
    return str(tiny_checkpoints["llama"])


@pytest.mark.parametrize("proposer", ["ngram", "draft-self"])
def test_speculation_over_fp8_kv_gives_the_tokens_of_the_plain_fp8_engine(checkpoint, proposer):
    prompts, params = workload(stop_token=5)
    plain = LLM(checkpoint, device="cpu", dtype="float32", **FP8)
    expected, expected_values = run(plain, prompts, params)
    llm = LLM(checkpoint, device="cpu", dtype="float32", **FP8, **proposers(checkpoint)[proposer])
    assert llm.engine.pool.dtype == torch.float8_e4m3fn
    got, values = run(llm, prompts, params)
    assert got == expected
    assert values == pytest.approx(expected_values, abs=1e-4) and values
    stats = llm.engine.stats().spec_decode
    assert stats.num_verifies > 0 and stats.num_accepted_tokens > 0
    if proposer == "draft-self":  # the draft's own pool: the model's dtype, not FP8
        proposer_ = llm.engine.spec.proposer  # type: ignore[union-attr]
        assert proposer_.kv_caches[0][0].dtype == torch.float32
