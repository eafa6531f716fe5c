"""The decode split policy chosen on the host from the batch size (no Triton needed)."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.attention.decode_launch_config import (
    DEFAULT_MAX_SPLITS,
    DEFAULT_MIN_PARTITION_LEN,
    FILL_CONTEXT_LEN,
    MAX_SPLITS,
    MIN_PARTITION_FLOOR,
    PROGRAMS_PER_SM,
    DecodeLaunchConfig,
    decode_launch_config,
    decode_splits,
    default_policy_config,
)

H200_SMS = 132
LLAMA3_KV_HEADS = 8


def slices(seq_len: int, min_partition_len: int, max_splits: int, block_n: int) -> int:
    """What the kernel's _request_partition_len cuts a request into (the valid slices)."""
    parts = max(min(max_splits, math.ceil(seq_len / min_partition_len)), 1)
    partition = max(math.ceil(math.ceil(seq_len / parts) / block_n) * block_n, block_n)
    return math.ceil(seq_len / partition)


@pytest.mark.parametrize(
    ("num_decodes", "expected"),
    [(1, (64, 33)), (2, (64, 17)), (3, (128, 16)), (4, (128, 16)), (5, (192, 16)),
     (6, (192, 16)), (7, (256, 16)), (32, (256, 16)), (128, (256, 16))],
)  # fmt: skip
def test_h200_llama3_policy(num_decodes: int, expected: tuple[int, int]) -> None:
    """The values the kernel module's docstring states for an H200 and 8 kv heads."""
    assert decode_splits(num_decodes, LLAMA3_KV_HEADS, H200_SMS, 64) == expected


def test_num_slices_mirrors_the_kernel_split() -> None:
    for fields in [(64, 33, 64, 4, 3), (1, 3, 32, 4, 2), (256, 16, 64, 4, 3), (64, 1, 64, 4, 3),
                   (192, 16, 128, 8, 2)]:  # fmt: skip
        config = DecodeLaunchConfig(*fields)
        for seq_len in [1, 31, 64, 65, 200, 1000, 1024, 4096, 5000]:
            assert config.num_slices(seq_len) == slices(seq_len, *fields[:3])


def test_batch_1_context_1k_takes_16_slices_of_64_keys() -> None:
    min_partition_len, max_splits = decode_splits(1, LLAMA3_KV_HEADS, H200_SMS, 64)
    assert slices(1024, min_partition_len, max_splits, 64) == 16
    assert slices(4096, min_partition_len, max_splits, 64) == 32  # 128-key slices


@pytest.mark.parametrize("block_n", [16, 32, 64, 128])
@pytest.mark.parametrize("num_sms", [1, 8, 78, 132, 148])
@pytest.mark.parametrize("num_kv_heads", [1, 2, 8, 32])
def test_bounds_and_never_fewer_slices_than_the_default(
    block_n: int, num_sms: int, num_kv_heads: int
) -> None:
    for num_decodes in [*range(1, 20), 24, 32, 64, 128, 256, 512]:
        min_partition_len, max_splits = decode_splits(num_decodes, num_kv_heads, num_sms, block_n)
        assert min_partition_len % block_n == 0
        assert max(MIN_PARTITION_FLOOR, block_n) <= min_partition_len
        assert min_partition_len <= max(DEFAULT_MIN_PARTITION_LEN, block_n)
        assert DEFAULT_MAX_SPLITS <= max_splits <= MAX_SPLITS
        for seq_len in [1, 2, 63, 64, 65, 255, 256, 257, 1000, 1024, 2048, 4097, 32768]:
            default = slices(seq_len, DEFAULT_MIN_PARTITION_LEN, DEFAULT_MAX_SPLITS, block_n)
            assert slices(seq_len, min_partition_len, max_splits, block_n) >= default


@pytest.mark.parametrize("num_kv_heads", [1, 2, 8])
def test_large_batches_keep_the_default_policy(num_kv_heads: int) -> None:
    """A batch with PROGRAMS_PER_SM programs per SM without splitting gets the old policy."""
    num_decodes = math.ceil(PROGRAMS_PER_SM * H200_SMS / num_kv_heads)
    for bs in (num_decodes, 2 * num_decodes, 4096):
        assert decode_splits(bs, num_kv_heads, H200_SMS, 64) == (
            DEFAULT_MIN_PARTITION_LEN,
            DEFAULT_MAX_SPLITS,
        )


@pytest.mark.parametrize("num_decodes", [1, 2, 3, 4, 5, 6])
def test_small_batches_fill_the_gpu_at_the_fill_context(num_decodes: int) -> None:
    """At FILL_CONTEXT_LEN keys the grid's live programs come to about two per SM (slice
    lengths round up to whole tiles), or as many as 64-key slices allow (batch 1)."""
    min_partition_len, max_splits = decode_splits(num_decodes, LLAMA3_KV_HEADS, H200_SMS, 64)
    num_slices = slices(FILL_CONTEXT_LEN, min_partition_len, max_splits, 64)
    programs = num_decodes * LLAMA3_KV_HEADS * num_slices
    floor_programs = num_decodes * LLAMA3_KV_HEADS * FILL_CONTEXT_LEN // MIN_PARTITION_FLOOR
    assert programs >= min(H200_SMS, floor_programs)
    # splits_to_fill rounds up: at most one slice per (request, kv head) over the aim
    assert programs <= PROGRAMS_PER_SM * H200_SMS + num_decodes * LLAMA3_KV_HEADS


def test_decode_launch_config_uses_the_dtype_tile() -> None:
    assert decode_launch_config(torch.bfloat16, 1, 8, H200_SMS) == DecodeLaunchConfig(
        64, 33, 64, 4, 3
    )
    assert decode_launch_config(torch.float32, 128, 8, H200_SMS) == DecodeLaunchConfig(
        256, 16, 32, 4, 2
    )
    assert default_policy_config(torch.float16) == DecodeLaunchConfig(256, 16, 64, 4, 3)
    assert default_policy_config(torch.float16).label() == "P256 S16 N64 w4 s3"


@pytest.mark.parametrize(
    "fields",
    [(0, 16, 64, 4, 3), (64, 0, 64, 4, 3), (64, MAX_SPLITS + 1, 64, 4, 3), (64, 16, 48, 4, 3),
     (64, 16, 8, 4, 3)],
)  # fmt: skip
def test_config_rejects_bad_values(fields: tuple[int, ...]) -> None:
    with pytest.raises(ValueError):
        DecodeLaunchConfig(*fields)


def test_policy_rejects_empty_sizes() -> None:
    with pytest.raises(ValueError):
        decode_splits(0, 8, H200_SMS, 64)
