"""The decode split policy chosen on the host from the batch size (no Triton needed)."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.attention.decode_launch_config import (
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
    [(1, (64, 33)), (2, (64, 17)), (3, (64, 11)), (8, (64, 5)), (16, (64, 3)),
     (32, (64, 2)), (33, (64, 1)), (128, (64, 1))],
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
def test_bounds_and_grid_size(block_n: int, num_sms: int, num_kv_heads: int) -> None:
    """Slices of at least 64 keys (whole tiles); the grid never exceeds two programs per SM by
    more than one slice per (request, kv head), and a long enough context fills it."""
    for num_decodes in [*range(1, 20), 24, 32, 64, 128, 256, 512]:
        min_partition_len, max_splits = decode_splits(num_decodes, num_kv_heads, num_sms, block_n)
        assert min_partition_len % block_n == 0
        assert (
            max(MIN_PARTITION_FLOOR, block_n) <= min_partition_len < MIN_PARTITION_FLOOR + block_n
        )
        assert 1 <= max_splits <= MAX_SPLITS
        pairs = num_decodes * num_kv_heads
        assert pairs * max_splits <= PROGRAMS_PER_SM * num_sms + pairs
        for seq_len in [1, 2, 63, 64, 65, 255, 256, 257, 1000, 1024, 2048, 4097, 32768]:
            assert 1 <= slices(seq_len, min_partition_len, max_splits, block_n) <= max_splits
        long_context = max_splits * min_partition_len
        if max_splits < MAX_SPLITS:
            programs = pairs * slices(long_context, min_partition_len, max_splits, block_n)
            assert programs >= PROGRAMS_PER_SM * num_sms


@pytest.mark.parametrize("num_kv_heads", [1, 2, 8])
def test_batches_that_fill_the_gpu_do_not_split(num_kv_heads: int) -> None:
    """Two programs per SM from (request, kv head) pairs alone: one slice per request."""
    num_decodes = math.ceil(PROGRAMS_PER_SM * H200_SMS / num_kv_heads)
    for bs in (num_decodes, 2 * num_decodes, 4096):
        assert decode_splits(bs, num_kv_heads, H200_SMS, 64)[1] == 1


def test_decode_launch_config_uses_the_dtype_tile() -> None:
    assert decode_launch_config(torch.bfloat16, 1, 8, H200_SMS) == DecodeLaunchConfig(
        64, 33, 64, 4, 3
    )
    assert decode_launch_config(torch.float32, 128, 8, H200_SMS) == DecodeLaunchConfig(
        64, 1, 32, 4, 2
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
