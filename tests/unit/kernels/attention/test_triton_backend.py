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


def test_per_request_splits_fp32_and_batch_invariant() -> None:
    """partition_len None: each request splits its own context (here into up to 3 slices);
    its result is the same alone as in a batch (what CUDA graph padding relies on)."""
    batch = make_batch(
        [1, 1, 1, 5], [700, 40, 300, 20], 3, num_heads=4, num_kv_heads=2, head_dim=16,
        block_size=16, device=DEVICE, seed=11,
    )  # fmt: skip
    compare(batch, TritonAttentionBackend(), atol=1e-5, rtol=1e-5)
    meta = batch.meta
    first_only = dataclasses.replace(
        meta, query_start_loc=meta.query_start_loc[:2], seq_lens=meta.seq_lens[:1],
        slot_mapping=meta.slot_mapping[:1], block_tables=meta.block_tables[:1], max_query_len=1,
        max_seq_len=meta.seq_lens_cpu[0], num_decodes=1, query_lens_cpu=(1,),
        seq_lens_cpu=meta.seq_lens_cpu[:1],
    )  # fmt: skip
    backend = TritonAttentionBackend()
    args = (batch.k_cache, batch.v_cache)
    out_batch = backend.forward(batch.q, batch.k, batch.v, *args, meta, batch.scale)
    out_alone = backend.forward(batch.q[:1], batch.k[:1], batch.v[:1], *args, first_only,
                                batch.scale)  # fmt: skip
    assert torch.equal(out_alone[0], out_batch[0])
