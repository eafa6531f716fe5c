"""Paged attention with Triton kernels: the default backend on CUDA.

The cache write, where the layer's fused rotary+KV write (kernels/fused) has not already stored
k/v, is torch `index_copy_` (one launch each for K and V); decodes run one split-K
kernel (plus a merge kernel when a context is split), prefills one kernel. Measured through
`forward` on an H200, llama3-8b layer, bf16, block size 16, CUDA graph replay
(benchmarks/kernels/bench_attention.py, benchmarks/results/2026-11-30-h200-attention.txt): decode batch 64
context 1K 3.49 TB/s, prefill 303-369 TFLOP/s. flash_attn has no figure yet (not built there).
"""

from __future__ import annotations

import functools

import torch
import triton

from kernels import pdl
from kernels.attention.backend import AttentionBackend
from kernels.attention.decode_launch_config import (
    DecodeLaunchConfig,
    decode_launch_config,
)
from kernels.attention.metadata import AttentionMetadata
from kernels.attention.torch_backend import write_kv_cache
from kernels.attention.triton_paged_attention import (
    LOG2E,
    paged_decode_kernel,
    paged_decode_reduce_kernel,
    paged_prefill_kernel,
)


class TritonAttentionBackend(AttentionBackend):
    """Split-K paged decode + varlen causal paged prefill."""

    name = "triton"

    def __init__(
        self,
        decode_partition_len: int | None = None,
        decode_config: DecodeLaunchConfig | None = None,
    ) -> None:
        # Keys per decode split; None: each request splits its own context (graph-safe).
        self.decode_partition_len = decode_partition_len
        # The decode launch (tests, sweeps); None: chosen per batch size (decode_launch_config).
        self.decode_config = decode_config

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype, block_size: int) -> bool:
        return device.type == "cuda" and dtype in (torch.float16, torch.bfloat16, torch.float32)

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
        kv_written: bool = False,  # the caller already stored k/v at meta.slot_mapping
        kv_scales: torch.Tensor | None = None,  # [2, num_kv_heads]: an FP8 cache's scales
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        if q.shape[1] % k.shape[1] != 0:
            raise ValueError(
                f"num_heads ({q.shape[1]}) must be a multiple of num_kv_heads ({k.shape[1]})"
            )
        if not kv_written:
            write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping, kv_scales)
        v_scale = None
        if k_cache.dtype == torch.float8_e4m3fn:  # the kernels read FP8 tiles as bf16
            q, v_scale = _fold_fp8_scales(q, kv_scales)
        out = self._attend(q, k_cache, v_cache, meta, scale)
        return out if v_scale is None else out.mul_(v_scale)

    def _attend(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        out = torch.empty_like(q)
        num_decodes = meta.num_decodes
        if num_decodes > 0:
            paged_decode_attention(
                out, q, k_cache, v_cache, meta.block_tables, meta.seq_lens, num_decodes,
                meta.max_seq_len, scale, self.decode_partition_len, self.decode_config,
                meta.decode_query_len,
            )  # fmt: skip
        if meta.num_reqs > num_decodes:
            paged_prefill_attention(
                out, q, k_cache, v_cache, meta.block_tables, meta.query_start_loc,
                meta.seq_lens, num_decodes, max(meta.query_lens_cpu[num_decodes:]), scale,
            )  # fmt: skip
        return out


def _fold_fp8_scales(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_scales: torch.Tensor | None,  # [2, num_kv_heads] float32
) -> tuple[torch.Tensor, torch.Tensor]:  # (q * k_scale, v_scale [num_heads, 1]) per q head
    """An FP8 cache's scales around the kernels, which read the stored values: a score is
    q . (k_scale * k_stored) = (k_scale * q) . k_stored, and an output row is v_scale times
    the weighted sum of stored V rows (each q head takes its KV head's scales). Two small
    launches, graph-safe (no host read)."""
    if kv_scales is None:
        raise ValueError("an FP8 KV cache needs its kv_scales ([2, num_kv_heads])")
    group = q.shape[1] // kv_scales.shape[1]
    per_head = kv_scales.repeat_interleave(group, dim=1).to(q.dtype)  # [2, num_heads]
    return q * per_head[0][:, None], per_head[1][:, None]


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 caches (tests, debugging) get exact products; fp16/bf16 ignore the setting.
    return "ieee" if dtype == torch.float32 else "tf32"


def _cache_strides(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int]:
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError(
            "k_cache and v_cache need the same strides and a contiguous head_dim; "
            f"got {k_cache.stride()} and {v_cache.stride()}"
        )
    return k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)


def _prefill_config(dtype: torch.dtype, head_dim: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of the prefill kernel.

    bf16, llama3-8b layer on an H200: 64/64/4/2 ran at 285-368 TFLOP/s, the best of a sweep of
    BLOCK_M 64/128, BLOCK_N 32/64/128, 4/8 warps, 2-4 stages.
    """
    if dtype == torch.float32 or head_dim > 128:
        return 64, 32, 4, 2
    return 64, 64, 4, 2


# The Triton interpreter (CPU) has no SMs; any value works there (it only sets how many
# slices a request is cut into).
INTERPRETER_NUM_SMS = 8


@functools.cache
def _num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (INTERPRETER_NUM_SMS elsewhere)."""
    if device.type != "cuda":
        return INTERPRETER_NUM_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def paged_decode_attention(
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim]; rows [0, num_decodes) written
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_reqs, max_blocks_per_req] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    num_decodes: int,
    max_seq_len: int,  # an upper bound of the decodes' seq_lens (used with partition_len)
    scale: float,
    partition_len: int | None = None,  # keys per split; None: per request, in the kernel
    config: DecodeLaunchConfig | None = None,  # None: decode_launch_config of this batch
    query_len: int = 1,  # query tokens per decode (K + 1 in a verify batch), causal
) -> None:
    """`query_len` queries per request (the first `num_decodes`; request d owns rows
    [d * query_len, (d + 1) * query_len)) over its whole paged context, causal among the
    request's new tokens; one program reads each K/V tile once for all of them.

    With `partition_len=None` the launch depends on `num_decodes`, the cache shape and the GPU
    alone, and no host value of the batch's lengths is read: safe to capture in a CUDA graph,
    and a request's result does not depend on the other requests of its batch (each request
    cuts its context by its own length; see triton_paged_attention's split policy)."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    num_heads = q.shape[1]
    if config is None:
        config = decode_launch_config(q.dtype, num_decodes, num_kv_heads, _num_sms(q.device))
    block_n = config.block_n
    if partition_len is None:
        partition_len, num_splits = 0, config.max_splits
    elif partition_len % block_n != 0:
        raise ValueError(f"partition_len must be a multiple of {block_n}, got {partition_len}")
    else:
        num_splits = triton.cdiv(max_seq_len, partition_len)
    head_dim_pad = triton.next_power_of_2(head_dim)
    num_tokens = num_decodes * query_len
    partial_out = partial_lse = out  # unused placeholders when there is one split
    if num_splits > 1:
        partial_out = q.new_empty(
            num_tokens, num_heads, num_splits, head_dim_pad, dtype=torch.float32
        )
        partial_lse = q.new_empty(num_tokens, num_heads, num_splits, dtype=torch.float32)
    group = num_heads // num_kv_heads
    paged_decode_kernel[(num_decodes, num_kv_heads, num_splits)](
        out, partial_out, partial_lse, q, k_cache, v_cache, block_tables, seq_lens,
        scale * LOG2E, partition_len, config.min_partition_len,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        *_cache_strides(k_cache, v_cache), block_tables.stride(0),
        SINGLE_SPLIT=num_splits == 1, NUM_QUERIES_PER_KV=group, QUERY_LEN=query_len,
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        BLOCK_G=max(16, triton.next_power_of_2(query_len * group)), BLOCK_N=block_n,
        DOT_PRECISION=_dot_precision(q.dtype), num_warps=config.num_warps,
        num_stages=config.num_stages, **pdl.options(num_tokens),
    )  # fmt: skip
    if num_splits > 1:
        paged_decode_reduce_kernel[(num_tokens, num_heads)](
            out, partial_out, partial_lse, seq_lens, partition_len, config.min_partition_len,
            out.stride(0), out.stride(1), num_splits, QUERY_LEN=query_len,
            SPLITS_PAD=triton.next_power_of_2(num_splits),
            HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_N=block_n, num_warps=4,
            **pdl.options(num_tokens),
        )  # fmt: skip


def paged_prefill_attention(
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim]; prefill rows written
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_reqs, max_blocks_per_req] int32
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    first_req: int,
    max_query_len: int,  # over the prefills
    scale: float,
) -> None:
    """Causal attention of requests [first_req, num_reqs) over cached prefix + new tokens."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    num_heads = q.shape[1]
    num_prefills = seq_lens.shape[0] - first_req
    block_m, block_n, num_warps, num_stages = _prefill_config(q.dtype, head_dim)
    grid = (num_heads, triton.cdiv(max_query_len, block_m), num_prefills)
    paged_prefill_kernel[grid](
        out, q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, first_req,
        scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        *_cache_strides(k_cache, v_cache), block_tables.stride(0),
        NUM_QUERIES_PER_KV=num_heads // num_kv_heads, BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_M=block_m, BLOCK_N=block_n, DOT_PRECISION=_dot_precision(q.dtype),
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
