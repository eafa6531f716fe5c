"""Triton paged attention kernels: split-K decode and varlen causal prefill over a block table.

Both read K/V only from the paged cache `[num_blocks, block_size, num_kv_heads, head_dim]`
(this step's tokens are written there first), addressing each key token through the request's
block table, so any block size works. Softmax is online (flash-attention style) in base 2.

```
decode   grid (num_decodes, num_kv_heads, num_splits): one program = one request, one kv head,
         one slice of the context; all q heads of the group, and all QUERY_LEN query tokens of
         the request (K + 1 in a speculative verify batch, causal among themselves), share
         each K/V tile load: the verify step reads the context once, as a decode does.
         num_splits > 1: partial (out, lse) per slice, then paged_decode_reduce_kernel merges them.
         partition_len 0: each request cuts its own context into min(num_splits,
         cdiv(seq_len, min_partition_len)) slices, computed in the kernel from seq_lens, so
         the grid depends on no host value of the batch's lengths (CUDA graphs).
prefill  grid (num_heads, num_q_tiles, num_prefills): one program = BLOCK_M queries of one
         request and head; keys up to the tile's last position, causal mask on the diagonal.
```

Decode split policy: `decode_splits` in kernels/attention/decode_launch_config.py (the
policy, its reasons and its measurements).

A request's result depends on its own context and the batch's launch config only: within one
batch size (one graph) it is independent of the other requests, but the same request at two
batch sizes may be split differently (equal up to float rounding, not bit for bit).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels import pdl

LOG2E = 1.4426950408889634


@triton.jit
def _request_partition_len(
    seq_len, partition_len, num_splits, min_partition_len, BLOCK_N: tl.constexpr
):
    """Keys per slice of one request: `partition_len` when > 0, else its context cut into
    min(num_splits, cdiv(seq_len, min_partition_len)) slices rounded up to BLOCK_N."""
    if partition_len > 0:
        return partition_len
    num_parts = tl.maximum(tl.minimum(num_splits, tl.cdiv(seq_len, min_partition_len)), 1)
    return tl.maximum(tl.cdiv(tl.cdiv(seq_len, num_parts), BLOCK_N) * BLOCK_N, BLOCK_N)


@triton.jit
def _load_kv_tile(
    cache_ptr,
    block_table_ptr,  # this request's row of block_tables
    offs_n,  # [BLOCK_N] key positions
    offs_d,  # [HEAD_DIM_PAD]
    kv_head,
    stride_cache_block,
    stride_cache_token,
    stride_cache_head,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    end_n,  # keys >= end_n read as 0
    MASKED: tl.constexpr,
):
    """K or V rows for key positions `offs_n`: [BLOCK_N, HEAD_DIM_PAD]."""
    in_range = offs_n < end_n
    if MASKED:
        block_ids = tl.load(block_table_ptr + offs_n // BLOCK_SIZE, mask=in_range, other=0)
    else:
        block_ids = tl.load(block_table_ptr + offs_n // BLOCK_SIZE)
    row_offs = (
        block_ids.to(tl.int64) * stride_cache_block
        + (offs_n % BLOCK_SIZE) * stride_cache_token
        + kv_head * stride_cache_head
    )
    ptrs = cache_ptr + row_offs[:, None] + offs_d[None, :]
    if MASKED:
        tile = tl.load(ptrs, mask=in_range[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
    elif HEAD_DIM != HEAD_DIM_PAD:
        tile = tl.load(ptrs, mask=(offs_d < HEAD_DIM)[None, :], other=0.0)
    else:
        tile = tl.load(ptrs)
    if cache_ptr.dtype.element_ty == tl.float8e4nv:  # FP8 KV: exact in fp16 (the scales are
        return tile.to(tl.float16)  # applied around the kernel: triton_backend.forward)
    else:  # (an else: a static branch's return does not end the function being compiled)
        return tile


@triton.jit
def _scores(q, k, scale_log2, DOT_PRECISION: tl.constexpr):
    """q [M, HEAD_DIM_PAD] . k [BLOCK_N, HEAD_DIM_PAD] -> [M, BLOCK_N] fp32, log2 domain."""
    return tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * scale_log2


@triton.jit
def _online_softmax_step(
    acc,  # [M, HEAD_DIM_PAD] fp32, unnormalized output
    m_i,  # [M] running max (log2 domain)
    l_i,  # [M] running sum of exp2
    s,  # [M, BLOCK_N] scores (log2 domain), -inf where hidden
    v,  # [BLOCK_N, HEAD_DIM_PAD]
    DOT_PRECISION: tl.constexpr,
    EMPTY_ROWS: tl.constexpr = False,  # a row may have seen no visible key yet: -inf max as 0
):
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = m_new
    if EMPTY_ROWS:  # (a verify query whose causal limit lies before this split): no NaN
        m_use = tl.where(m_new > float("-inf"), m_new, 0.0)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def paged_decode_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]; used when SINGLE_SPLIT
    partial_out_ptr,  # [num_decode_tokens, num_heads, num_splits, HEAD_DIM_PAD] fp32
    partial_lse_ptr,  # [num_decode_tokens, num_heads, num_splits] fp32, log2 domain
    q_ptr,  # [num_tokens, num_heads, head_dim]; decode d owns rows [d * QUERY_LEN, + QUERY_LEN)
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,  # [num_reqs, max_blocks_per_req]
    seq_lens_ptr,  # [num_reqs]
    scale_log2,
    partition_len,  # keys per split, a multiple of BLOCK_N; 0: per request (see above)
    min_partition_len,  # keys, >= 1; used when partition_len is 0
    stride_q_token,
    stride_q_head,
    stride_out_token,
    stride_out_head,
    stride_cache_block,
    stride_cache_token,
    stride_cache_head,
    stride_block_table,
    SINGLE_SPLIT: tl.constexpr,  # num_splits == 1: write the output directly
    NUM_QUERIES_PER_KV: tl.constexpr,
    QUERY_LEN: tl.constexpr,  # query tokens per request (1; K + 1 in a verify batch)
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_G: tl.constexpr,  # QUERY_LEN x q heads of a group, padded to >= 16 for tl.dot
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,  # launched with PDL (kernels/pdl.py): wait for the kernel before
):
    pdl.wait_then_release(USE_PDL)
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + req)
    partition_len = _request_partition_len(
        seq_len, partition_len, tl.num_programs(2), min_partition_len, BLOCK_N
    )
    start_n = split * partition_len
    if start_n >= seq_len:
        return  # the reduce kernel skips splits past the context
    end_n = tl.minimum(seq_len, start_n + partition_len)

    # Row r of the tile: query token r // group of the request, q head r % group of kv_head.
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    query = offs_g // NUM_QUERIES_PER_KV  # [BLOCK_G] query token within the request
    heads = kv_head * NUM_QUERIES_PER_KV + offs_g % NUM_QUERIES_PER_KV
    g_mask = offs_g < QUERY_LEN * NUM_QUERIES_PER_KV
    qo_mask = g_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    tokens = req.to(tl.int64) * QUERY_LEN + query
    q_ptrs = q_ptr + tokens[:, None] * stride_q_token + heads[:, None] * stride_q_head
    q = tl.load(q_ptrs + offs_d[None, :], mask=qo_mask, other=0.0)  # [BLOCK_G, HEAD_DIM_PAD]
    # Causal among the request's new tokens: query i sees keys <= seq_len - QUERY_LEN + i;
    # keys < causal_end are visible to every query (all of them when QUERY_LEN == 1).
    limits = seq_len - QUERY_LEN + query  # [BLOCK_G] last visible key of each row
    causal_end = tl.minimum(end_n, seq_len - QUERY_LEN + 1)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM_PAD], tl.float32)
    block_table_ptr = block_tables_ptr + req.to(tl.int64) * stride_block_table
    full_end = start_n + tl.maximum(causal_end - start_n, 0) // BLOCK_N * BLOCK_N
    for tile_n in range(start_n, full_end, BLOCK_N):
        offs_n = tile_n + tl.arange(0, BLOCK_N)
        k = _load_kv_tile(k_cache_ptr, block_table_ptr, offs_n, offs_d, kv_head,
                          stride_cache_block, stride_cache_token, stride_cache_head,
                          BLOCK_SIZE, HEAD_DIM, HEAD_DIM_PAD, end_n, False)  # fmt: skip
        v = _load_kv_tile(v_cache_ptr, block_table_ptr, offs_n, offs_d, kv_head,
                          stride_cache_block, stride_cache_token, stride_cache_head,
                          BLOCK_SIZE, HEAD_DIM, HEAD_DIM_PAD, end_n, False)  # fmt: skip
        s = _scores(q, k, scale_log2, DOT_PRECISION)
        acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, s, v, DOT_PRECISION)
    for tile_n in range(full_end, end_n, BLOCK_N):  # the context's tail: length and causal mask
        offs_n = tile_n + tl.arange(0, BLOCK_N)
        k = _load_kv_tile(k_cache_ptr, block_table_ptr, offs_n, offs_d, kv_head,
                          stride_cache_block, stride_cache_token, stride_cache_head,
                          BLOCK_SIZE, HEAD_DIM, HEAD_DIM_PAD, end_n, True)  # fmt: skip
        v = _load_kv_tile(v_cache_ptr, block_table_ptr, offs_n, offs_d, kv_head,
                          stride_cache_block, stride_cache_token, stride_cache_head,
                          BLOCK_SIZE, HEAD_DIM, HEAD_DIM_PAD, end_n, True)  # fmt: skip
        s = _scores(q, k, scale_log2, DOT_PRECISION)
        visible = (offs_n < end_n)[None, :] & (offs_n[None, :] <= limits[:, None])
        s = tl.where(visible, s, float("-inf"))
        acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, s, v, DOT_PRECISION, True)

    if SINGLE_SPLIT:
        out_ptrs = out_ptr + tokens[:, None] * stride_out_token + heads[:, None] * stride_out_head
        out = acc / l_i[:, None]
        tl.store(out_ptrs + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=qo_mask)
    else:
        # A row that sees no key of this slice (a verify query before its start): lse -inf,
        # output 0, so the merge gives the slice no weight.
        num_heads = tl.num_programs(1) * NUM_QUERIES_PER_KV
        row = (tokens * num_heads + heads) * tl.num_programs(2) + split
        l_safe = tl.where(l_i > 0, l_i, 1.0)  # m_i is -inf where l_i is 0
        tl.store(partial_lse_ptr + row, m_i + tl.log2(l_safe), mask=g_mask)
        partial = acc / l_safe[:, None]
        partial_ptrs = partial_out_ptr + row[:, None] * HEAD_DIM_PAD + offs_d[None, :]
        tl.store(partial_ptrs, partial, mask=g_mask[:, None])


@triton.jit
def paged_decode_reduce_kernel(
    out_ptr,
    partial_out_ptr,  # [num_decode_tokens, num_heads, num_splits, HEAD_DIM_PAD] fp32
    partial_lse_ptr,  # [num_decode_tokens, num_heads, num_splits] fp32
    seq_lens_ptr,
    partition_len,
    min_partition_len,
    stride_out_token,
    stride_out_head,
    num_splits,
    QUERY_LEN: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,  # the decode kernel's
    USE_PDL: tl.constexpr,
):
    """Merge the splits of one (query token, head): softmax-weighted by each split's lse."""
    pdl.wait_then_release(USE_PDL)
    token = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + token // QUERY_LEN)
    partition_len = _request_partition_len(
        seq_len, partition_len, num_splits, min_partition_len, BLOCK_N
    )
    num_valid = tl.cdiv(seq_len, partition_len)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    s_mask = offs_s < num_valid
    row0 = (token * tl.num_programs(1) + head) * num_splits
    lse = tl.load(partial_lse_ptr + row0 + offs_s, mask=s_mask, other=float("-inf"))
    weights = tl.exp2(lse - tl.max(lse, 0))
    weights = weights / tl.sum(weights, 0)  # [SPLITS_PAD]
    partial_ptrs = partial_out_ptr + (row0 + offs_s)[:, None].to(tl.int64) * HEAD_DIM_PAD
    partial = tl.load(partial_ptrs + offs_d[None, :], mask=s_mask[:, None], other=0.0)
    out = tl.sum(partial * weights[:, None], 0)  # [HEAD_DIM_PAD]
    out_ptrs = out_ptr + token.to(tl.int64) * stride_out_token + head * stride_out_head + offs_d
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


@triton.jit
def paged_prefill_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,  # [num_reqs, max_blocks_per_req]
    query_start_loc_ptr,  # [num_reqs + 1]
    seq_lens_ptr,  # [num_reqs]
    first_req,  # index of the first prefill request
    scale_log2,
    stride_q_token,
    stride_q_head,
    stride_out_token,
    stride_out_head,
    stride_cache_block,
    stride_cache_token,
    stride_cache_head,
    stride_block_table,
    NUM_QUERIES_PER_KV: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    head = tl.program_id(0)
    req = first_req + tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + req)
    query_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    # Last tiles first: they see the most keys, so the long programs start early.
    tile_m = tl.num_programs(1) - 1 - tl.program_id(1)
    if tile_m * BLOCK_M >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - query_len
    kv_head = head // NUM_QUERIES_PER_KV

    offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    qo_mask = (offs_m < query_len)[:, None] & (offs_d < HEAD_DIM)[None, :]
    tokens = (q_start + offs_m).to(tl.int64)
    q_ptrs = q_ptr + tokens[:, None] * stride_q_token + head * stride_q_head + offs_d[None, :]
    q = tl.load(q_ptrs, mask=qo_mask, other=0.0)  # [BLOCK_M, HEAD_DIM_PAD]
    positions = context_len + offs_m  # [BLOCK_M]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    block_table_ptr = block_tables_ptr + req.to(tl.int64) * stride_block_table
    # Keys below the tile's first position are visible to every row: no mask there.
    end_n = tl.minimum(seq_len, context_len + (tile_m + 1) * BLOCK_M)
    full_end = (context_len + tile_m * BLOCK_M + 1) // BLOCK_N * BLOCK_N
    for tile_n in range(0, full_end, BLOCK_N):
        offs_n = tile_n + tl.arange(0, BLOCK_N)
        k = _load_kv_tile(k_cache_ptr, block_table_ptr, offs_n, offs_d, kv_head,
                          stride_cache_block, stride_cache_token, stride_cache_head,
                          BLOCK_SIZE, HEAD_DIM, HEAD_DIM_PAD, end_n, False)  # fmt: skip
        v = _load_kv_tile(v_cache_ptr, block_table_ptr, offs_n, offs_d, kv_head,
                          stride_cache_block, stride_cache_token, stride_cache_head,
                          BLOCK_SIZE, HEAD_DIM, HEAD_DIM_PAD, end_n, False)  # fmt: skip
        s = _scores(q, k, scale_log2, DOT_PRECISION)
        acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, s, v, DOT_PRECISION)
    for tile_n in range(full_end, end_n, BLOCK_N):
        offs_n = tile_n + tl.arange(0, BLOCK_N)
        k = _load_kv_tile(k_cache_ptr, block_table_ptr, offs_n, offs_d, kv_head,
                          stride_cache_block, stride_cache_token, stride_cache_head,
                          BLOCK_SIZE, HEAD_DIM, HEAD_DIM_PAD, end_n, True)  # fmt: skip
        v = _load_kv_tile(v_cache_ptr, block_table_ptr, offs_n, offs_d, kv_head,
                          stride_cache_block, stride_cache_token, stride_cache_head,
                          BLOCK_SIZE, HEAD_DIM, HEAD_DIM_PAD, end_n, True)  # fmt: skip
        s = _scores(q, k, scale_log2, DOT_PRECISION)
        s = tl.where(offs_n[None, :] <= positions[:, None], s, float("-inf"))
        acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, s, v, DOT_PRECISION)

    out_ptrs = out_ptr + tokens[:, None] * stride_out_token + head * stride_out_head
    out = acc / l_i[:, None]
    tl.store(out_ptrs + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=qo_mask)
