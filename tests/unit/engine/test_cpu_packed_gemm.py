"""A bf16 model on a CPU with bf16 instructions runs its projections on weights packed once for
oneDNN (kernels/gemm/cpu_packed.py), with the same tokens as F.linear; fp32 is left alone."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine import LLM, SamplingParams
from kernels.gemm import cpu_packed
from tests.unit.engine.conftest import random_prompts

pytestmark = pytest.mark.skipif(
    not cpu_packed.supported(torch.device("cpu"), torch.bfloat16),
    reason="this CPU has no bf16 instructions (AMX-BF16 / AVX512-BF16) or torch no oneDNN",
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def make_llm(checkpoint, dtype: str) -> LLM:
    return LLM(str(checkpoint), device="cpu", dtype=dtype, num_blocks=256)


def projections(llm: LLM) -> list[nn.Linear]:
    return [m for m in llm.engine.loaded.model.modules() if isinstance(m, nn.Linear)]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])  # untied, tied + QKV bias, qk-norm
def test_bf16_packs_every_projection_and_keeps_the_tokens(
    tiny_checkpoints, monkeypatch: pytest.MonkeyPatch, arch: str
) -> None:
    prompts = random_prompts(12, 512, seed=3, min_len=2, max_len=50)
    packed = make_llm(tiny_checkpoints[arch], "bfloat16")
    model = packed.engine.loaded.model
    assert model.layer_ops.name == "reference+onednn_packed"
    assert projections(packed) and all(m.weight.is_mkldnn for m in projections(packed))
    tied = model.lm_head is None
    assert (model._packed_logits_weight is not None) == tied
    if tied:
        assert not model.model.embed_tokens.weight.is_mkldnn  # the lookup keeps its table
    got = [o.token_ids for o in packed.generate(prompts, GREEDY)]
    packed.engine.check_no_leaks()

    monkeypatch.setenv("PDSERVE_CPU_PACKED_GEMM", "0")
    plain = make_llm(tiny_checkpoints[arch], "bfloat16")
    assert plain.engine.loaded.model.layer_ops.name == "reference"
    assert not any(m.weight.is_mkldnn for m in projections(plain))
    assert got == [o.token_ids for o in plain.generate(prompts, GREEDY)]


def test_fp32_keeps_f_linear(tiny_checkpoints) -> None:
    llm = make_llm(tiny_checkpoints["llama"], "float32")
    assert llm.engine.loaded.model.layer_ops.name == "reference"
    assert not any(m.weight.is_mkldnn for m in projections(llm))
