"""A bf16/fp16 model on CPU decodes through the C++ attention kernel (cpu_paged_decode). Forced
on in fp32, where rounding differences are far below the tiny models' logit gaps, it gives
gather + SDPA's tokens exactly."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from kernels.attention import cpu_paged_decode
from tests.unit.engine.conftest import random_prompts

pytestmark = pytest.mark.skipif(
    not cpu_paged_decode.available(),
    reason="the CPU decode kernel did not build (no C++ compiler?)",
)

PARAMS = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def make_llm(checkpoint, dtype: str, kernel: bool | None = None) -> LLM:
    llm = LLM(str(checkpoint), device="cpu", dtype=dtype, num_blocks=256)
    if kernel is not None:
        llm.engine.attn_backend.cpu_decode_kernel = kernel
    return llm


def generate(llm: LLM, prompts) -> list[list[int]]:
    tokens = [o.token_ids for o in llm.generate(prompts, PARAMS)]
    llm.engine.check_no_leaks()
    return tokens


def test_16_bit_models_take_it_unless_switched_off(
    tiny_checkpoints, monkeypatch: pytest.MonkeyPatch
) -> None:
    checkpoint = tiny_checkpoints["llama"]
    llm = make_llm(checkpoint, "bfloat16")
    assert llm.engine.attn_backend.cpu_decode_kernel is True
    prompts = random_prompts(6, 512, seed=8, min_len=2, max_len=60)
    assert all(len(t) == PARAMS.max_tokens for t in generate(llm, prompts))
    assert make_llm(checkpoint, "float32").engine.attn_backend.cpu_decode_kernel is False
    monkeypatch.setenv("PDSERVE_CPU_ATTENTION_KERNEL", "0")
    assert make_llm(checkpoint, "bfloat16").engine.attn_backend.cpu_decode_kernel is False


@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # GQA 2:1 / head_dim 32
def test_fp32_tokens_equal_gather_and_sdpa(tiny_checkpoints, arch: str) -> None:
    prompts = random_prompts(12, 512, seed=8, min_len=2, max_len=60)
    kernel = generate(make_llm(tiny_checkpoints[arch], "float32", kernel=True), prompts)
    sdpa = generate(make_llm(tiny_checkpoints[arch], "float32", kernel=False), prompts)
    assert kernel == sdpa
