"""TP N computes what TP 1 does (CPU, gloo): logits within 1e-4 at every sampled row, the same
greedy tokens, on synthetic qwen3 / llama shapes (one with fewer kv heads than ranks, so they
replicate), a Hugging Face checkpoint with biases, and the default model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM, SamplingParams
from engine.engine_core import EngineCore
from kernels.gemm import cpu_packed
from tests.unit.engine.conftest import random_prompts
from tests.unit.engine.distributed.tp_models import build_biased_llama

# Small steps so the longer prompts prefill in chunks; a shared prefix hits the prefix cache.
# The same pool size on every engine (a budget in bytes holds more blocks of fewer kv heads),
# so TP 1 and TP N schedule the same steps.
ENGINE = dict(device="cpu", dtype="float32", num_blocks=64, max_num_batched_tokens=32)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def capture_logits(core: EngineCore) -> list[torch.Tensor]:
    """Every logits tensor rank 0's sampler gets, in order (the gathered, whole vocab)."""
    seen: list[torch.Tensor] = []
    launch = core.runner.sampler.launch

    def spy(logits: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        seen.append(logits.detach().clone())
        return launch(logits, *args, **kwargs)

    core.runner.sampler.launch = spy  # type: ignore[method-assign]
    return seen


def run(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], list[torch.Tensor]]:
    logits = capture_logits(llm.engine)
    tokens = [out.token_ids for out in llm.generate(prompts, GREEDY)]
    llm.engine.check_no_leaks()
    return tokens, logits


def prompts_for(vocab_size: int, num_prompts: int = 4) -> list[list[int]]:
    prompts = random_prompts(num_prompts, vocab_size, seed=3, max_len=40)
    return [*prompts, prompts[0][:20] + [5, 6, 7]]  # shares a prefix with the first


def assert_tp_matches_tp1(model: str, world_size: int, num_prompts: int = 4, **kwargs: Any) -> None:
    reference = LLM(model, **ENGINE, **kwargs)
    prompts = prompts_for(reference.engine.arch.vocab_size, num_prompts)
    want_tokens, want_logits = run(reference, prompts)
    llm = LLM(model, **ENGINE, tensor_parallel_size=world_size, **kwargs)
    try:
        assert llm.engine.pool.kv_caches[0][0].shape[2] == llm.engine.tp.shard.num_kv_heads
        tokens, logits = run(llm, prompts)
    finally:
        llm.close()
    assert tokens == want_tokens
    assert len(logits) == len(want_logits)
    for got, want in zip(logits, want_logits):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    ("model", "world_size", "kwargs"),
    [
        ("synthetic:tiny-qwen3", 2, {}),  # 4 heads, 2 kv heads: one each
        ("synthetic:tiny-llama:kv_heads=1,vocab=509", 2, {}),  # replicated; padded vocab
        ("synthetic:tiny-qwen2", 2, {}),  # qkv bias, tied embedding
        ("synthetic:tiny-qwen3", 2, {"async_scheduling": "on"}),  # pending ids broadcast
    ],
)
def test_synthetic_tp_matches_tp1(model: str, world_size: int, kwargs: dict[str, Any]) -> None:
    assert_tp_matches_tp1(model, world_size, **kwargs)


@pytest.fixture(scope="module")
def biased_llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield build_biased_llama(tmp_path_factory.mktemp("tp") / "biased-llama")


def test_checkpoint_tp_matches_tp1(biased_llama: Path) -> None:
    """safetensors slices, and o_proj's bias added once (rank 0)."""
    assert_tp_matches_tp1(str(biased_llama), 2)


@pytest.mark.slow
def test_default_model_tp3_matches_tp1() -> None:
    """smollm2-135m: 9 heads and 3 kv heads, so 3 ranks (2 is refused: test_tp_faults)."""
    assert_tp_matches_tp1("smollm2-135m", 3, num_prompts=1)


@pytest.mark.skipif(
    not cpu_packed.supported(torch.device("cpu"), torch.bfloat16),
    reason="this CPU has no bf16 instructions (the packed projections need them)",
)
def test_bf16_packed_projections_run_on_sharded_weights() -> None:
    """bf16 on CPU: every rank's projections (and a tied LM head's embedding slice) packed for
    oneDNN; the partial sums round differently, so the logits (bf16 before the cast: a unit in
    the last place is 0.125 between 16 and 32) agree to two such units."""
    prompts = prompts_for(512, num_prompts=2)
    bf16 = {**ENGINE, "dtype": "bfloat16"}
    want_tokens, want_logits = run(LLM("synthetic:tiny-qwen2", **bf16), prompts)
    llm = LLM("synthetic:tiny-qwen2", **bf16, tensor_parallel_size=2)
    try:
        assert llm.engine.loaded.model.layer_ops.name.endswith("onednn_packed")
        tokens, logits = run(llm, prompts)
    finally:
        llm.close()
    assert tokens == want_tokens
    for got, want in zip(logits, want_logits):
        torch.testing.assert_close(got, want, atol=0.25, rtol=0)
