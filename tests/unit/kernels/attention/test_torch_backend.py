"""TorchAttentionBackend against a per-request dense reference on random paged batches."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from attention_batch import make_batch, reference_attention

from kernels.attention import TorchAttentionBackend

# (query_lens, context_lens, num_decodes): decodes first, then prefills with and without a
# cached prefix (chunked prefill), including a one-token prefill chunk after the decodes.
MIXED = ([1, 1, 1, 5, 1, 9, 17], [0, 7, 33, 12, 20, 0, 3], 3)
DECODE_ONLY = ([1, 1, 1, 1], [4, 0, 40, 17], 4)
PREFILL_ONLY = ([6, 13, 2], [0, 21, 9], 0)
# A speculative verify batch: 5 queries per decode (last token + 4 drafts), then prefills.
VERIFY = ([5, 5, 5, 9, 1], [0, 30, 61, 12, 20], 3)


def run_and_check(batch, atol: float, rtol: float) -> None:
    expected = reference_attention(batch)
    out = TorchAttentionBackend().forward(
        batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache, batch.meta, batch.scale
    )
    assert out.shape == batch.q.shape and out.dtype == batch.q.dtype
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize(
    "case", [MIXED, DECODE_ONLY, PREFILL_ONLY], ids=["mixed", "decode", "prefill"]
)
def test_matches_reference_fp32(block_size: int, group: int, case) -> None:
    query_lens, context_lens, num_decodes = case
    batch = make_batch(
        query_lens,
        context_lens,
        num_decodes,
        num_heads=2 * group,
        num_kv_heads=2,
        head_dim=16,
        block_size=block_size,
        seed=block_size * 10 + group,
    )
    run_and_check(batch, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("group", [1, 4])
def test_verify_batch_matches_reference_fp32(block_size: int, group: int) -> None:
    """K + 1 queries per decode, causal among themselves, over the paged context."""
    query_lens, context_lens, num_decodes = VERIFY
    batch = make_batch(
        query_lens, context_lens, num_decodes, num_heads=2 * group, num_kv_heads=2,
        head_dim=16, block_size=block_size, seed=group, decode_query_len=5,
    )  # fmt: skip
    run_and_check(batch, atol=1e-5, rtol=1e-5)
    lengths = [5, 5, 5, 5]  # spread contexts: several length groups
    batch = make_batch(
        lengths, [0, 200, 9, 90], 4, num_heads=4, num_kv_heads=2, head_dim=16,
        block_size=block_size, seed=7, decode_query_len=5,
    )  # fmt: skip
    run_and_check(batch, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_reference_half(dtype: torch.dtype) -> None:
    query_lens, context_lens, num_decodes = MIXED
    batch = make_batch(
        query_lens,
        context_lens,
        num_decodes,
        num_heads=8,
        num_kv_heads=2,
        head_dim=32,
        block_size=16,
        dtype=dtype,
        seed=7,
    )
    run_and_check(batch, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("block_size", [1, 16])
def test_cache_writes_land_at_slots_only(block_size: int) -> None:
    query_lens, context_lens, num_decodes = MIXED
    batch = make_batch(
        query_lens,
        context_lens,
        num_decodes,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        block_size=block_size,
        seed=3,
    )
    k_before, v_before = batch.clone_caches()
    TorchAttentionBackend().forward(
        batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache, batch.meta, batch.scale
    )
    slots = batch.meta.slot_mapping
    for cache, before, new in (
        (batch.k_cache, k_before, batch.k),
        (batch.v_cache, v_before, batch.v),
    ):
        flat, flat_before = cache.flatten(0, 1), before.flatten(0, 1)
        torch.testing.assert_close(flat[slots], new, atol=0, rtol=0)
        untouched = torch.ones(flat.shape[0], dtype=torch.bool)
        untouched[slots] = False
        torch.testing.assert_close(flat[untouched], flat_before[untouched], atol=0, rtol=0)


def test_block_table_padding_is_never_read() -> None:
    """Entries past a request's last block are padding: pointing them anywhere changes nothing."""
    query_lens, context_lens, num_decodes = MIXED
    batch = make_batch(
        query_lens,
        context_lens,
        num_decodes,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        block_size=4,
        seed=11,
    )
    expected = reference_attention(batch)
    used = {block_id for ids in batch.block_ids for block_id in ids}
    spare = next(b for b in range(batch.k_cache.shape[0]) if b not in used)
    batch.k_cache[spare] = 1e4  # finite garbage: masked, it must get zero weight
    batch.v_cache[spare] = 1e4
    poisoned = batch.meta.block_tables.clone()
    for i, ids in enumerate(batch.block_ids):
        poisoned[i, len(ids) :] = spare
    meta = dataclasses.replace(batch.meta, block_tables=poisoned)
    out = TorchAttentionBackend().forward(
        batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache, meta, batch.scale
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_rejects_heads_not_multiple_of_kv_heads() -> None:
    batch = make_batch([3], [0], 0, num_heads=5, num_kv_heads=2, head_dim=8, block_size=4)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        TorchAttentionBackend().forward(
            batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache, batch.meta, batch.scale
        )


def test_length_groups_cover_every_row_once_and_bound_padding() -> None:
    from kernels.attention.torch_step_plan import MAX_DECODE_GROUPS, length_groups

    gen = torch.Generator().manual_seed(0)
    seq_lens = tuple(torch.randint(1, 500, (64,), generator=gen).tolist())
    groups = length_groups(seq_lens)
    assert 1 < len(groups) <= MAX_DECODE_GROUPS
    rows = sorted(r for group_rows, _ in groups for r in group_rows)
    assert rows == list(range(64))
    for group_rows, max_len in groups[:-1]:
        assert max_len == max(seq_lens[r] for r in group_rows)
        assert min(seq_lens[r] for r in group_rows) >= 0.7 * max_len
    assert length_groups((10, 9, 8, 10)) == [([0, 3, 1, 2], 10)]  # close lengths: one group


@pytest.mark.parametrize("query_len", [1, 7], ids=["decode", "prefill"])
def test_lone_request_with_consecutive_blocks_reads_a_view(query_len: int) -> None:
    """One request whose blocks are consecutive attends over a view of the cache (no gather):
    exactly what the gather gives, and the reference's values."""
    from kernels.attention.torch_step_plan import step_plan

    batch = make_batch(
        [query_len], [37], int(query_len == 1), num_heads=6, num_kv_heads=2, head_dim=16,
        block_size=8, seed=11,
    )  # fmt: skip
    num_blocks = -(-(37 + query_len) // 8)
    consecutive = torch.arange(2, 2 + num_blocks, dtype=torch.int32)[None]
    meta = dataclasses.replace(batch.meta, block_tables=consecutive)
    # The same blocks' values, as a permuted copy the gather must read.
    scattered = dataclasses.replace(batch.meta, block_tables=consecutive.flip(1))
    k_copy, v_copy = batch.clone_caches()
    k_copy[consecutive.flip(1)[0].long()] = batch.k_cache[consecutive[0].long()]
    v_copy[consecutive.flip(1)[0].long()] = batch.v_cache[consecutive[0].long()]
    plan = step_plan(meta, 8)
    group = plan.decode_groups[0] if query_len == 1 else plan.prefill.group
    assert group.first_block == 2
    args = (batch.q, batch.k, batch.v)  # kv_written: the caches hold every key already
    viewed = TorchAttentionBackend().forward(
        *args, batch.k_cache, batch.v_cache, meta, 0.25, kv_written=True
    )
    gathered = TorchAttentionBackend().forward(
        *args, k_copy, v_copy, scattered, 0.25, kv_written=True
    )
    assert torch.equal(viewed, gathered)
