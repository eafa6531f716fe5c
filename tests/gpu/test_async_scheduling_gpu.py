"""Async scheduling on CUDA (decode graphs replayed with inputs read from the previous step's
ids on the device) gives the synchronous engine's tokens. Skipped without CUDA; the logic is
tested on CPU in tests/unit/engine/test_async_scheduling.py."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available"),
]
MODEL = "synthetic:smollm2-135m:layers=4"


def prompts(num: int = 14) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    lengths = torch.randint(3, 300, (num,), generator=gen).tolist()
    return [torch.randint(100, 49152, (n,), generator=gen).tolist() for n in lengths]


def run(mode: str, dtype: str, params, **kwargs):
    llm = LLM(MODEL, device="cuda", dtype=dtype, async_scheduling=mode, max_num_seqs=16,
              max_model_len=1024, **kwargs)  # fmt: skip
    assert llm.engine.async_scheduling == (mode == "on")
    outs = llm.generate(prompts(len(params)), params)
    llm.engine.check_no_leaks()
    if mode == "on":
        assert llm.engine.num_steps_ahead > 0
    return [(o.token_ids, o.finish_reason) for o in outs]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_async_decode_equals_sync_same_batches(dtype: str) -> None:
    """Every prompt prefilled in the first step, stops on length only: both engines run the
    same batches, so even bf16 must agree token for token."""
    params = [SamplingParams(temperature=0.0, max_tokens=4 + 5 * (i % 5), ignore_eos=True)
              for i in range(14)]  # fmt: skip
    kwargs = dict(max_num_batched_tokens=8192)
    assert run("on", dtype, params, **kwargs) == run("off", dtype, params, **kwargs)


def test_async_with_stops_seeds_and_preemption_fp32() -> None:
    """Stop tokens (the ahead step's token dropped), seeded sampling, logprobs and a pool too
    small for the batch (preemption), in fp32."""
    stop = run("off", "float32", [SamplingParams(temperature=0.0, max_tokens=6,
                                                 ignore_eos=True)] * 3)[1][0][3]  # fmt: skip
    kinds = [
        SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[stop]),
        SamplingParams(temperature=0.9, seed=11, max_tokens=15, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True),
    ]
    params = [kinds[i % 3] for i in range(14)]
    kwargs = dict(num_blocks=40)
    assert run("on", "float32", params, **kwargs) == run("off", "float32", params, **kwargs)
