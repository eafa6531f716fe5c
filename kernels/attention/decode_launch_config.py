"""`DecodeLaunchConfig`: how the Triton decode kernel is launched, chosen on the host.

```
decode_launch_config(dtype, num_decodes, num_kv_heads, num_sms)
    tile    BLOCK_N / num_warps / num_stages by dtype (tile_config)
    splits  min_partition_len / max_splits by batch size (decode_splits), below
```

Decode split policy (`decode_splits`). The decode kernel (triton_paged_attention.py)
reads each key once, so it runs at HBM bandwidth only while enough programs are in flight. A
small batch has few (request, kv head) pairs, 8 at batch 1 for llama3-8b, so the slices are all
the parallelism there is: a 1K context in 256-key slices gives 32 programs on a 132-SM H200,
each waiting on a few serial tile loads. The host picks `min_partition_len` and `max_splits`
(the grid's third dimension) from the batch size, the kv head count and the SM count alone,
never from a context length (a decode graph is captured per batch size and replayed with any
lengths):

```
max_splits         cdiv(2 * num_sms, num_decodes * num_kv_heads), at most 64: slices per
                   request that give two programs per SM (1 once the pairs alone do)
min_partition_len  64 keys (at least BLOCK_N): no slice shorter
```

Measured (`python3 -m benchmarks.kernels.attention_split_sweep`, one H200, llama3-8b layer, bf16,
benchmarks/results/2026-12-02-h200-attention-split-sweep.txt): the fastest setting at batch 1
is 16-32 slices of 64-128 keys; at batch 8 4-8 slices; at batch 32 one or two; at batch 128
no split at all (one program per (request, kv head) already makes 1024 programs: splitting
only adds partial writes and the merge). The former policy (256-key slices, up to 16 per
request, whatever the batch) cost 1.34x at batch 1 (11.7 vs 8.7 us) and 1.24x at batch 128
(161.9 vs 130.1 us), context 1K.

Every input is known on the host when a decode CUDA graph is captured (one graph per batch
size): nothing here reads a context length, so a graph stays valid for any lengths it is
replayed with. Torch-only (no Triton import), so the policy is testable on CPU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

# The policy the kernel had before the batch-size split policy (and keeps at large batch):
# slices of at least 256 keys, at most 16 per request.
DEFAULT_MIN_PARTITION_LEN = 256
DEFAULT_MAX_SPLITS = 16
PROGRAMS_PER_SM = 2  # aim: this many decode programs per SM, so the GPU fills about twice
MIN_PARTITION_FLOOR = 64  # keys: no slice shorter (a slice costs a partial write + merge)
MAX_SPLITS = 64  # the reduce kernel holds every split of a head in registers


@dataclass(frozen=True)
class DecodeLaunchConfig:
    """One launch of `paged_decode_kernel` (and its reduce) in per-request split mode.

    A request of `seq_len` keys is cut into min(max_splits, cdiv(seq_len, min_partition_len))
    slices of equal length rounded up to `block_n` (so no slice is shorter than block_n); the
    grid's third dimension is `max_splits`, whose programs past the context return at once.
    """

    min_partition_len: int  # keys, >= 1
    max_splits: int  # slices per request at most, in [1, MAX_SPLITS]
    block_n: int  # keys per K/V tile, a power of two >= 16
    num_warps: int
    num_stages: int

    def __post_init__(self) -> None:
        if self.min_partition_len < 1:
            raise ValueError(f"min_partition_len must be >= 1, got {self.min_partition_len}")
        if not 1 <= self.max_splits <= MAX_SPLITS:
            raise ValueError(f"max_splits must be in [1, {MAX_SPLITS}], got {self.max_splits}")
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise ValueError(f"block_n must be a power of two >= 16, got {self.block_n}")

    def num_slices(self, seq_len: int) -> int:
        """The slices a request of `seq_len` keys is cut into (the kernel's
        `_request_partition_len`, on the host: for tables and tests, never for a launch)."""
        parts = max(min(self.max_splits, _cdiv(seq_len, self.min_partition_len)), 1)
        partition_len = max(_cdiv(_cdiv(seq_len, parts), self.block_n) * self.block_n, self.block_n)
        return _cdiv(seq_len, partition_len)

    def label(self) -> str:
        """`P256 S16 N64 w4 s3`: min partition, max splits, BLOCK_N, warps, stages."""
        return (
            f"P{self.min_partition_len} S{self.max_splits} N{self.block_n} "
            f"w{self.num_warps} s{self.num_stages}"
        )


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def tile_config(dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) of the decode kernel.

    bf16, llama3-8b layer on an H200: 64/4/3 with splits filling the GPU twice over was the
    best of a sweep of BLOCK_N 32/64/128, 4/8 warps, 2-4 stages, 2-16 programs per SM
    (batch 64 context 1K: 3.49 TB/s through `forward`, cache write included, in
    benchmarks/results/2026-11-30-h200-attention.txt; measured before the per-request split of
    `paged_decode_attention`).
    """
    return (32, 4, 2) if dtype == torch.float32 else (64, 4, 3)


def decode_splits(
    num_decodes: int, num_kv_heads: int, num_sms: int, block_n: int
) -> tuple[int, int]:
    """(min_partition_len, max_splits) for a decode batch of `num_decodes` requests.

    max_splits = cdiv(PROGRAMS_PER_SM * num_sms, num_decodes * num_kv_heads), at most
    MAX_SPLITS: the slices per request that give the grid PROGRAMS_PER_SM programs per SM (1
    once the (request, kv head) pairs alone do). min_partition_len = MIN_PARTITION_FLOOR
    (rounded up to block_n): a request cuts its context into max_splits slices unless they
    would be shorter than that.
    """
    if num_decodes < 1 or num_kv_heads < 1 or num_sms < 1:
        raise ValueError(f"need positive sizes, got {num_decodes=} {num_kv_heads=} {num_sms=}")
    max_splits = min(_cdiv(PROGRAMS_PER_SM * num_sms, num_decodes * num_kv_heads), MAX_SPLITS)
    return _cdiv(max(MIN_PARTITION_FLOOR, block_n), block_n) * block_n, max_splits


@functools.cache  # called per layer in eager decode: one small object per (dtype, batch)
def decode_launch_config(
    dtype: torch.dtype, num_decodes: int, num_kv_heads: int, num_sms: int
) -> DecodeLaunchConfig:
    """The default launch: the dtype's tile and the batch size's splits."""
    block_n, num_warps, num_stages = tile_config(dtype)
    min_partition_len, max_splits = decode_splits(num_decodes, num_kv_heads, num_sms, block_n)
    return DecodeLaunchConfig(min_partition_len, max_splits, block_n, num_warps, num_stages)


def default_policy_config(dtype: torch.dtype) -> DecodeLaunchConfig:
    """The batch-independent policy (256-key slices, 16 at most): the baseline of sweeps."""
    block_n, num_warps, num_stages = tile_config(dtype)
    return DecodeLaunchConfig(
        DEFAULT_MIN_PARTITION_LEN, DEFAULT_MAX_SPLITS, block_n, num_warps, num_stages
    )
