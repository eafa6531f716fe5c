"""CUDA-graph decode replay gives the same tokens as eager decode (greedy; fp32 and bf16; mixed
lengths; preemption; prefix hits), per attention backend. Skipped without CUDA."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from engine import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available"),
]
MODEL = "synthetic:smollm2-135m:layers=4"
BACKENDS = [
    "triton",
    "torch",
    pytest.param("flash_attn", marks=pytest.mark.skipif(
        importlib.util.find_spec("flash_attn") is None, reason="flash_attn is not installed")),
]  # fmt: skip


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    lengths = torch.randint(3, 400, (14,), generator=gen).tolist()
    out = [torch.randint(100, 49152, (n,), generator=gen).tolist() for n in lengths]
    return out + [out[0][:300] + [7, 8, 9]]  # a prefix hit


def run(backend: str, dtype: str, enforce_eager: bool, num_blocks: int | None):
    if backend == "flash_attn" and dtype == "float32":
        pytest.skip("flash_attn needs float16/bfloat16")
    llm = LLM(MODEL, device="cuda", dtype=dtype, attention_backend=backend,
              enforce_eager=enforce_eager, max_num_seqs=8, max_model_len=1024,
              num_blocks=num_blocks)  # fmt: skip
    graphs = llm.engine.runner.decode_graphs
    assert graphs is not None and graphs.captured == (not enforce_eager)
    params = [SamplingParams(temperature=0.0, max_tokens=5 + 4 * (i % 6), ignore_eos=True)
              for i in range(len(prompts()))]  # fmt: skip
    outs = llm.generate(prompts(), params)
    llm.engine.check_no_leaks()
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("num_blocks", [None, 40], ids=["roomy", "preempting"])
def test_graph_replay_equals_eager(backend: str, dtype: str, num_blocks) -> None:
    if backend == "flash_attn" and num_blocks is not None:
        num_blocks = 3  # 256-token blocks
    assert run(backend, dtype, False, num_blocks) == run(backend, dtype, True, num_blocks)
