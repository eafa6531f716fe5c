"""Compiled Triton (and flash-attn, when it imports) paged attention vs the torch reference on
CUDA, at realistic sizes: llama3-8b and smollm2 head shapes, long contexts, chunked prefill."""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("CUDA not available", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).parents[1] / "unit" / "kernels" / "attention"))
from attention_batch import make_batch  # noqa: E402

from kernels.attention import TorchAttentionBackend  # noqa: E402
from kernels.attention.triton_backend import TritonAttentionBackend  # noqa: E402

pytestmark = pytest.mark.gpu
HAS_FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}
# (num_heads, num_kv_heads, head_dim)
LLAMA3_8B = (32, 8, 128)
SMOLLM2 = (9, 3, 64)


def random_mix(num_decodes: int, num_prefills: int, max_context_len: int, max_query_len: int):
    """Decodes then prefills (some with a cached prefix), lengths drawn at random."""
    rng = random.Random(num_decodes * 1000 + num_prefills)
    query_lens = [1] * num_decodes + [rng.randint(1, max_query_len) for _ in range(num_prefills)]
    context_lens = [rng.randint(0, max_context_len) for _ in query_lens]
    context_lens[num_decodes::2] = [0] * len(context_lens[num_decodes::2])
    return query_lens, context_lens, num_decodes


def check(backend, shape, mix, block_size: int, dtype: torch.dtype, seed: int = 0) -> None:
    num_heads, num_kv_heads, head_dim = shape
    batch = make_batch(
        *mix, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        block_size=block_size, dtype=dtype, device="cuda", seed=seed,
    )  # fmt: skip
    k_cache, v_cache = batch.clone_caches()
    expected = TorchAttentionBackend().forward(
        batch.q, batch.k, batch.v, k_cache, v_cache, batch.meta, batch.scale
    )
    out = backend.forward(
        batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache, batch.meta, batch.scale
    )
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(batch.k_cache, k_cache, atol=0, rtol=0)
    torch.testing.assert_close(batch.v_cache, v_cache, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [LLAMA3_8B, SMOLLM2], ids=["llama3-8b", "smollm2"])
@pytest.mark.parametrize("block_size", [1, 16, 256])
def test_triton_mixed_batch(dtype, shape, block_size: int) -> None:
    mix = random_mix(num_decodes=24, num_prefills=5, max_context_len=1500, max_query_len=700)
    check(TritonAttentionBackend(), shape, mix, block_size, dtype)


@pytest.mark.parametrize(
    ("num_decodes", "max_context_len"), [(1, 16000), (4, 9000), (64, 1024), (256, 300)]
)
def test_triton_decode_splits(num_decodes: int, max_context_len: int) -> None:
    """Few long decodes take many splits; large batches take one."""
    mix = random_mix(num_decodes, 0, max_context_len, 1)
    check(TritonAttentionBackend(), LLAMA3_8B, mix, 16, torch.bfloat16)


def test_triton_long_chunked_prefill() -> None:
    mix = ([2048, 1000], [6000, 0], 0)
    check(TritonAttentionBackend(), LLAMA3_8B, mix, 16, torch.bfloat16)


@pytest.mark.skipif(not HAS_FLASH_ATTN, reason="flash_attn is not installed")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flash_attn_mixed_batch(dtype) -> None:
    from kernels.attention.flash_attn_backend import FlashAttnBackend

    mix = random_mix(num_decodes=24, num_prefills=5, max_context_len=1500, max_query_len=700)
    check(FlashAttnBackend(), LLAMA3_8B, mix, 256, dtype)
    check(FlashAttnBackend(), LLAMA3_8B, ([1] * 8, [3000] * 8, 8), 256, dtype, seed=1)
