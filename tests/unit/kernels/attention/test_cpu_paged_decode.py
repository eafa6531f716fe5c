"""The C++ CPU decode attention kernel (kernels/attention/cpu_paged_decode.cpp) against the
dense fp32 reference and the torch path, and its argument checks."""

from __future__ import annotations

import pytest
import torch
from attention_batch import make_batch, reference_attention

from kernels.attention import TorchAttentionBackend, cpu_paged_decode

pytestmark = pytest.mark.skipif(
    not cpu_paged_decode.available(),
    reason="the CPU decode kernel did not build (no C++ compiler?)",
)


def decode_batch(context_lens, dtype, block_size=16, group=3, head_dim=64, seed=0):
    return make_batch(
        [1] * len(context_lens), context_lens, len(context_lens), num_heads=2 * group,
        num_kv_heads=2, head_dim=head_dim, block_size=block_size, dtype=dtype, seed=seed,
    )  # fmt: skip


def kernel_out(batch, meta=None) -> torch.Tensor:
    meta = meta or batch.meta
    TorchAttentionBackend(cpu_decode_kernel=False).forward(  # stores this step's K/V
        batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache, meta, batch.scale
    )
    return cpu_paged_decode.paged_decode_attention(
        batch.q, batch.k_cache, batch.v_cache, meta.block_tables, meta.seq_lens, batch.scale
    )


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2),
                                        (torch.float16, 2e-3)])  # fmt: skip
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("group, head_dim", [(1, 64), (3, 64), (4, 24)])  # 24: a lane tail
def test_matches_the_dense_reference(dtype, tol, block_size, group, head_dim) -> None:
    batch = decode_batch([0, 7, 33, 200, 15], dtype, block_size, group, head_dim, seed=group)
    expected = reference_attention(batch)
    got = kernel_out(batch)
    assert got.shape == batch.q.shape and got.dtype == dtype
    torch.testing.assert_close(got.float(), expected, atol=tol, rtol=tol)


def test_a_row_does_not_depend_on_its_batch() -> None:
    """Each (request, KV head) is summed in a fixed order: bitwise the same alone or batched."""
    batch = decode_batch([40, 3, 120, 64], torch.bfloat16, seed=5)
    together = kernel_out(batch)
    meta = batch.meta
    for row in range(4):
        alone = cpu_paged_decode.paged_decode_attention(
            batch.q[row : row + 1], batch.k_cache, batch.v_cache,
            meta.block_tables[row : row + 1], meta.seq_lens[row : row + 1], batch.scale,
        )  # fmt: skip
        assert torch.equal(alone[0], together[row])


def test_block_table_padding_is_never_read() -> None:
    batch = decode_batch([5, 30, 2], torch.float32, block_size=4, seed=9)
    expected = kernel_out(batch)
    used = {block_id for ids in batch.block_ids for block_id in ids}
    spare = next(b for b in range(batch.k_cache.shape[0]) if b not in used)
    batch.k_cache[spare] = float("nan")  # read, it would poison the output
    batch.v_cache[spare] = float("nan")
    poisoned = batch.meta.block_tables.clone()
    for i, ids in enumerate(batch.block_ids):
        poisoned[i, len(ids) :] = spare
    got = cpu_paged_decode.paged_decode_attention(
        batch.q, batch.k_cache, batch.v_cache, poisoned, batch.meta.seq_lens, batch.scale
    )
    assert torch.equal(got, expected)


def test_rejects_what_it_cannot_read_safely() -> None:
    batch = decode_batch([5, 9], torch.float32, block_size=4)
    meta, args = batch.meta, (batch.q, batch.k_cache, batch.v_cache)
    bad_block = meta.block_tables.clone()
    bad_block[0, 0] = batch.k_cache.shape[0]
    too_long = meta.seq_lens.clone()
    too_long[1] = 4 * meta.block_tables.shape[1] + 1
    cases = [
        ((*args, bad_block, meta.seq_lens, 1.0), "outside the cache"),
        ((*args, meta.block_tables, too_long, 1.0), "does not fit its block table"),
        ((*args, meta.block_tables, torch.zeros_like(meta.seq_lens), 1.0), "does not fit"),
        ((*args, meta.block_tables.long(), meta.seq_lens, 1.0), "int32"),
        ((batch.q.double(), *args[1:], meta.block_tables, meta.seq_lens, 1.0), "share a dtype"),
    ]
    threads = torch.get_num_threads()
    torch.set_num_threads(8)  # the checks run before the threads: none of them throws
    try:
        for call_args, message in cases:
            with pytest.raises(RuntimeError, match=message):
                cpu_paged_decode.paged_decode_attention(*call_args)
    finally:
        torch.set_num_threads(threads)


def test_the_torch_backend_takes_it_for_16_bit_decodes_only() -> None:
    """bf16/fp16 decode rows go to the kernel (their values: the kernel's); fp32 and prefill
    rows keep gather + SDPA (the reference)."""
    batch = make_batch([1, 1, 6], [20, 3, 9], 2, num_heads=6, num_kv_heads=2, head_dim=32,
                       block_size=16, dtype=torch.bfloat16, seed=4)  # fmt: skip
    k_before, v_before = batch.clone_caches()
    fast = TorchAttentionBackend(cpu_decode_kernel=True).forward(
        batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache, batch.meta, batch.scale
    )
    direct = cpu_paged_decode.paged_decode_attention(
        batch.q[:2], batch.k_cache, batch.v_cache, batch.meta.block_tables[:2],
        batch.meta.seq_lens[:2], batch.scale,
    )  # fmt: skip
    assert torch.equal(fast[:2], direct)
    batch.k_cache.copy_(k_before)
    batch.v_cache.copy_(v_before)
    plain = TorchAttentionBackend(cpu_decode_kernel=False).forward(
        batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache, batch.meta, batch.scale
    )
    assert torch.equal(fast[2:], plain[2:])  # the prefill rows: the same SDPA
    torch.testing.assert_close(fast[:2].float(), plain[:2].float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(
    "value, want", [(None, True), ("", True), ("1", True), ("0", False), ("on", None)]
)
def test_env_var_parses(monkeypatch: pytest.MonkeyPatch, value, want) -> None:
    from pdserve import envs
    from tests.env_vars import assert_env_reads

    assert_env_reads(
        monkeypatch, "PDSERVE_CPU_ATTENTION_KERNEL", value, want, envs.cpu_attention_kernel
    )


def test_the_selector_gives_it_to_16_bit_cpu_models_only() -> None:
    from kernels.attention import get_attention_backend

    cpu = torch.device("cpu")
    for dtype, want in ((torch.bfloat16, True), (torch.float16, True), (torch.float32, False)):
        assert get_attention_backend("auto", cpu, dtype, 16).cpu_decode_kernel is want
    off = get_attention_backend("torch", cpu, torch.bfloat16, 16, cpu_decode_kernel=False)
    assert off.cpu_decode_kernel is False
