"""The model on the fused Triton layer ops (kernels/fused, on CPU through the Triton
interpreter) gives the same greedy tokens as on the torch reference ops, for each tiny
architecture (Llama, Qwen2 with QKV bias, Qwen3 with q/k norm); the reference ops are what the
CPU engine uses."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton", reason="triton is not installed (pip install --no-deps triton)")

from engine import LLM, SamplingParams  # noqa: E402
from kernels.fused import REFERENCE_OPS  # noqa: E402
from kernels.fused.layer_ops import triton_ops  # noqa: E402
from tests.unit.engine.conftest import random_prompts  # noqa: E402


def test_the_cpu_engine_runs_the_reference_ops() -> None:
    llm = LLM("synthetic:tiny-llama", device="cpu", dtype="float32")
    assert llm.engine.loaded.model.layer_ops is REFERENCE_OPS


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen2", "tiny-qwen3"])
def test_triton_ops_give_the_reference_tokens(model: str) -> None:
    llm = LLM(
        f"synthetic:{model}",
        device="cpu",
        dtype="float32",
        max_num_seqs=4,
        enable_prefix_caching=False,
    )  # the second run recomputes everything
    prompts = random_prompts(4, 512, seed=5, min_len=3, max_len=20)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    want = [o.token_ids for o in llm.generate(prompts, params)]
    llm.engine.loaded.model.set_layer_ops(triton_ops())
    assert llm.engine.loaded.model.layer_ops.name == "triton"
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert got == want
    llm.engine.check_no_leaks()
