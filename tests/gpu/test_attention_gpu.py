"""Compiled Triton (and flash-attn, when it imports) paged attention vs the torch reference on
CUDA, at realistic sizes: llama3-8b and smollm2 head shapes, long contexts, chunked prefill."""

from __future__ import annotations

import dataclasses
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
from kernels.attention.decode_launch_config import DecodeLaunchConfig  # noqa: E402
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


# Contexts (seq_len, this step's token included) around tile and slice edges, 1 to 2048.
EDGE_SEQ_LENS = [1, 2, 15, 16, 17, 63, 64, 65, 127, 128, 129, 255, 256, 257, 511, 700, 1000,
                 1023, 1024, 1025, 1500, 2047, 2048]  # fmt: skip
# None: the launch chosen for the batch size on this GPU; then explicit small-batch launches
# (min_partition_len, max_splits, BLOCK_N, num_warps, num_stages), whatever the SM count.
SMALL_BATCH_LAUNCHES = [
    None,
    DecodeLaunchConfig(64, 33, 64, 4, 3),
    DecodeLaunchConfig(64, 64, 64, 4, 3),
    DecodeLaunchConfig(32, 64, 32, 4, 3),
    DecodeLaunchConfig(16, 64, 16, 2, 2),
    DecodeLaunchConfig(128, 17, 128, 8, 2),
    DecodeLaunchConfig(192, 16, 64, 4, 3),
    DecodeLaunchConfig(64, 1, 64, 4, 3),
]


@pytest.mark.parametrize("launch", SMALL_BATCH_LAUNCHES, ids=lambda c: c and c.label())
@pytest.mark.parametrize("num_decodes", [1, 2])
def test_triton_small_batch_decode_splits(num_decodes: int, launch) -> None:
    """Batch 1 and 2 at every context in EDGE_SEQ_LENS (batch 2: paired with the reversed
    list), small slices merged by lse, against the torch reference."""
    backend = TritonAttentionBackend(decode_config=launch)
    for i, seq_len in enumerate(EDGE_SEQ_LENS):
        seq_lens = [seq_len, EDGE_SEQ_LENS[-1 - i]][:num_decodes]
        mix = ([1] * num_decodes, [n - 1 for n in seq_lens], num_decodes)
        check(backend, LLAMA3_8B, mix, 16, torch.bfloat16, seed=i)


def test_triton_small_batch_decode_fp32_exact() -> None:
    """fp32 products: the 64-key slices of batch 1 merge to the reference within 1e-4."""
    backend = TritonAttentionBackend(decode_config=DecodeLaunchConfig(64, 33, 32, 4, 2))
    for i, seq_len in enumerate(EDGE_SEQ_LENS):
        check(backend, LLAMA3_8B, ([1], [seq_len - 1], 1), 16, torch.float32, seed=i)


@pytest.mark.parametrize("num_decodes", [1, 2])
def test_triton_decode_graph_replays_any_lengths(num_decodes: int) -> None:
    """One CUDA graph of the default launch, captured at the capacity (2048 keys), replayed
    with new seq_lens written into its buffer: each replay equals the reference at those
    lengths (the host chose the launch from the batch size only)."""
    capacity = EDGE_SEQ_LENS[-1]
    batch = make_batch(
        [1] * num_decodes, [capacity - 1] * num_decodes, num_decodes, num_heads=32,
        num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16, device="cuda",
    )  # fmt: skip
    args = (batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache)
    static_meta = dataclasses.replace(batch.meta, static_shapes=True)
    backend = TritonAttentionBackend()
    backend.forward(*args, static_meta, batch.scale, kv_written=True)  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(*args, static_meta, batch.scale, kv_written=True)
    for i, seq_len in enumerate(EDGE_SEQ_LENS):
        seq_lens = (seq_len, EDGE_SEQ_LENS[-1 - i])[:num_decodes]
        static_meta.seq_lens.copy_(torch.tensor(seq_lens, dtype=torch.int32))
        graph.replay()
        meta = dataclasses.replace(
            batch.meta, seq_lens=static_meta.seq_lens.clone(), seq_lens_cpu=seq_lens,
            max_seq_len=max(seq_lens),
        )  # fmt: skip
        expected = TorchAttentionBackend().forward(*args, meta, batch.scale, kv_written=True)
        tol = TOLERANCE[torch.bfloat16]
        torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)


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
