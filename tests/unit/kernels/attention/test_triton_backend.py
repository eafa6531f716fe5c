"""Triton paged attention against the torch reference, on CPU through the Triton interpreter.

Tiny shapes: the interpreter runs every program in numpy. tests/gpu/test_attention_gpu.py runs
the compiled kernels at realistic sizes.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import torch
from attention_batch import make_batch


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(".")[:2])


if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated (imported)
triton = pytest.importorskip(
    "triton", reason="triton is not installed (pip install --no-deps 'triton>=3.7')"
)
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
if INTERPRETING and _version(triton.__version__) < (3, 7) and _version(np.__version__) >= (2, 4):
    # Older interpreters call int() on 1-element arrays, which numpy >= 2.4 refuses.
    pytest.skip(
        f"the triton {triton.__version__} interpreter needs numpy < 2.4; "
        "pip install --no-deps 'triton>=3.7'",
        allow_module_level=True,
    )

from kernels.attention import TorchAttentionBackend  # noqa: E402
from kernels.attention.decode_launch_config import DecodeLaunchConfig  # noqa: E402
from kernels.attention.triton_backend import TritonAttentionBackend  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# decodes first; prefills cross the 64-query tile and have cached prefixes (chunked prefill)
MIXED = ([1, 1, 1, 70, 1, 9], [0, 45, 100, 30, 64, 0], 3)


def compare(batch, backend, atol: float, rtol: float) -> None:
    k_cache, v_cache = batch.clone_caches()
    expected = TorchAttentionBackend().forward(
        batch.q, batch.k, batch.v, k_cache, v_cache, batch.meta, batch.scale
    )
    out = backend.forward(
        batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache, batch.meta, batch.scale
    )
    assert out.shape == batch.q.shape and out.dtype == batch.q.dtype
    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=rtol)
    torch.testing.assert_close(batch.k_cache, k_cache, atol=0, rtol=0)
    torch.testing.assert_close(batch.v_cache, v_cache, atol=0, rtol=0)


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("partition_len", [32, 4096], ids=["split", "one-split"])
def test_mixed_batch_fp32(block_size: int, group: int, partition_len: int) -> None:
    query_lens, context_lens, num_decodes = MIXED
    batch = make_batch(
        query_lens, context_lens, num_decodes, num_heads=2 * group, num_kv_heads=2,
        head_dim=16, block_size=block_size, device=DEVICE, seed=group,
    )  # fmt: skip
    compare(batch, TritonAttentionBackend(partition_len), atol=1e-5, rtol=1e-5)


def test_head_dim_not_power_of_two() -> None:
    query_lens, context_lens, num_decodes = MIXED
    batch = make_batch(
        query_lens, context_lens, num_decodes, num_heads=4, num_kv_heads=2, head_dim=24,
        block_size=16, device=DEVICE, seed=5,
    )  # fmt: skip
    compare(batch, TritonAttentionBackend(32), atol=1e-5, rtol=1e-5)


def test_fp16_mixed_batch() -> None:
    query_lens, context_lens, num_decodes = MIXED
    batch = make_batch(
        query_lens, context_lens, num_decodes, num_heads=8, num_kv_heads=2, head_dim=32,
        block_size=16, dtype=torch.float16, device=DEVICE, seed=9,
    )  # fmt: skip
    compare(batch, TritonAttentionBackend(64), atol=2e-3, rtol=2e-3)


def test_decode_partition_len_must_match_tile() -> None:
    batch = make_batch([1], [40], 1, num_heads=2, num_kv_heads=2, head_dim=16, block_size=16)
    with pytest.raises(ValueError, match="multiple of 32"):
        TritonAttentionBackend(48).forward(
            batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache, batch.meta, batch.scale
        )


def test_per_request_splits_fp32_and_independent_of_other_requests() -> None:
    """partition_len None: each request splits its own context (here in up to 3 slices, the
    launch chosen for 3 decodes); its result does not depend on the other requests of a batch
    of the same size (what a CUDA graph, captured per batch size, relies on)."""
    batch = make_batch(
        [1, 1, 1, 5], [700, 40, 300, 20], 3, num_heads=4, num_kv_heads=2, head_dim=16,
        block_size=16, device=DEVICE, seed=11,
    )  # fmt: skip
    compare(batch, TritonAttentionBackend(), atol=1e-5, rtol=1e-5)
    meta = batch.meta
    seq_lens_cpu = (701, 7, 100, meta.seq_lens_cpu[3])  # shorter contexts for decodes 1 and 2
    other = dataclasses.replace(
        meta, seq_lens=torch.tensor(seq_lens_cpu, dtype=torch.int32, device=DEVICE),
        seq_lens_cpu=seq_lens_cpu,
    )  # fmt: skip
    backend = TritonAttentionBackend()
    args = (batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache)
    out = backend.forward(*args, meta, batch.scale, kv_written=True)
    out_other = backend.forward(*args, other, batch.scale, kv_written=True)
    assert torch.equal(out_other[0], out[0])


# (min_partition_len, max_splits): a slice per 32-key tile; partitions shorter than a tile
# (rounded up to it); odd split counts; one split (the kernel writes the output itself)
SMALL_SPLITS = [(32, 64), (1, 3), (64, 17), (96, 5), (256, 1)]


@pytest.mark.parametrize(("min_partition_len", "max_splits"), SMALL_SPLITS)
def test_explicit_decode_launch_config_fp32(min_partition_len: int, max_splits: int) -> None:
    """Contexts around the tile and slice edges, merged by lse, equal the reference."""
    seq_lens = [1, 2, 31, 32, 33, 65, 200, 257]
    batch = make_batch(
        [1] * len(seq_lens), [n - 1 for n in seq_lens], len(seq_lens), num_heads=4,
        num_kv_heads=2, head_dim=16, block_size=16, device=DEVICE, seed=min_partition_len,
    )  # fmt: skip
    config = DecodeLaunchConfig(min_partition_len, max_splits, 32, 4, 2)
    compare(batch, TritonAttentionBackend(decode_config=config), atol=1e-5, rtol=1e-5)


def test_batch_1_default_launch_cuts_small_slices_fp32() -> None:
    """A lone decode gets the small-batch policy (on the interpreter's 8 SMs and 2 kv heads:
    128-key slices, up to 16)."""
    batch = make_batch(
        [1], [1000], 1, num_heads=4, num_kv_heads=2, head_dim=16, block_size=16,
        device=DEVICE, seed=3,
    )  # fmt: skip
    compare(batch, TritonAttentionBackend(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("partition_len", [32, None, 4096], ids=["split", "auto", "one-split"])
def test_verify_batch_fp32(group: int, partition_len: int | None) -> None:
    """Speculative verify rows (5 queries per decode, causal among themselves) through the
    decode kernel, contexts around tile and slice edges (a query may see nothing of the last
    slice), then prefills; equal to the torch reference."""
    query_lens = [5, 5, 5, 5, 5, 9, 1]
    context_lens = [0, 27, 28, 60, 300, 12, 20]
    batch = make_batch(
        query_lens, context_lens, 5, num_heads=2 * group, num_kv_heads=2, head_dim=16,
        block_size=16, device=DEVICE, seed=group, decode_query_len=5,
    )  # fmt: skip
    compare(batch, TritonAttentionBackend(partition_len), atol=1e-5, rtol=1e-5)


def test_verify_batch_small_slices_fp32() -> None:
    """Slices of one tile: the causal tail spans two slices."""
    batch = make_batch(
        [4, 4, 4], [29, 30, 95], 3, num_heads=3, num_kv_heads=1, head_dim=16, block_size=1,
        device=DEVICE, seed=2, decode_query_len=4,
    )  # fmt: skip
    config = DecodeLaunchConfig(32, 8, 32, 4, 2)
    compare(batch, TritonAttentionBackend(decode_config=config), atol=1e-5, rtol=1e-5)
