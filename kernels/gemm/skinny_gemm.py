"""The skinny GEMM: y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for few tokens (M <= 128) in ONE
Triton launch, streaming W (the nn.Linear layout, K contiguous) once from HBM.

```
grid (cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N) * split_k,)   the M tiles of one N tile (and the
         split programs of one tile) are adjacent programs
program: acc[BLOCK_N, BLOCK_M] fp32 = sum over K (or its split's run), BLOCK_K at a time, of
         W tile . x tile^T (+ bias), rounded once to the dtype, stored transposed into y [M, N]
         (split: the fp32 tile to the workspace; a reduce launch sums the splits into y)
dot path  (M padded to >= 16): acc += tl.dot(W [BLOCK_N, BLOCK_K], x^T [BLOCK_K, BLOCK_M])
          W is the mma's A operand ("swap AB"): BLOCK_N is its wide dim, the tokens its narrow one
          (mma.sync m16n8k16 for small tiles; wgmma once BLOCK_N >= 64 and BLOCK_M >= 64)
fma path  (tiny M, no padding): acc3[BLOCK_N, BLOCK_M, BLOCK_K] += W * x in fp32, summed over K
          once after the loop (no per-step shuffles)
prologues on the x tile as it loads (one launch instead of two):
  GATED   x is gate | up: the tile is silu(gate) * up             (the MLP's down projection)
  NORMED  s = residual (+ x) stored once as the new residual; the tile is s * norm weight; the
          per-row sum of s^2 accumulates alongside, and 1/rms scales acc after the K loop
                                                                  (QKV and gate_up)
```

Both tiles are loaded straight in the layout they are used in (x as the x^T tile [BLOCK_K,
BLOCK_M], no tl.trans on the dot path) and the loop is a `tl.range(num_stages=...)`: so Triton
pipelines BOTH loads with 16-byte cp.async into num_stages - 1 shared-memory buffers, the fma
path included (a plain `range` loop without a dot is not pipelined, and a transposed x tile was
loaded synchronously every step). Checked offline for sm_90 (triton.compile with the launcher's
divisibility hints, PTX read): 16-byte cp.async for W and x, no scalar global loads, 48-72
registers for the table's launches, wgmma for the 64 x 64 tiles of M = 128.

At decode sizes the GEMM reads W (N*K*2 bytes) and next to nothing else, so it is bound by HBM
bandwidth: the launch must keep enough loads in flight on every SM (num_stages deep) over enough
programs. With one token the N tiles alone fill the GPU (a 4096-row W in 8-row tiles is 512
programs for 132 SMs); the tl.dot tiles of 32-128 tokens are wider (BLOCK_N 32-128: 32-128
programs for a 4096-row W), so a launch may split K (`split_k`): split_k adjacent programs per
output tile, each over an equal run of whole BLOCK_K steps, store fp32 partial tiles to a
workspace [split_k, M, N], and a second launch (`_split_k_reduce_kernel`) sums them in split
order, adds the bias and rounds once. No atomics: each output is the same sum in the same order
every run (bitwise deterministic), though not bitwise the unsplit launch's. The fused RMSNorm
needs the whole of K in one program (its sum of squares): it never splits. The launch comes from
`skinny_gemm_config`'s table (host-side, no autotuning, no sync: CUDA-graph safe; the workspace
is a torch allocation, from the graph's pool when captured).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.gemm.skinny_config import MAX_M, SkinnyGemmConfig, skinny_gemm_config

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Triton's CPU interpreter (the unit tests) multiplies bfloat16 tiles as their raw uint16 bits:
# there, and only there, the dot path converts bfloat16 tiles to float32 first.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_REDUCE_BLOCK = 1024  # outputs per program of the split-K reduce launch


@triton.jit
def _residual_sum(x_ptrs, r_ptrs, mask, HAS_ADD: tl.constexpr):
    """residual (+ x), rounded to the dtype where add_rms_norm rounds the sum."""
    s = tl.load(r_ptrs, mask=mask, other=0.0)
    if HAS_ADD:
        x = tl.load(x_ptrs, mask=mask, other=0.0)
        s = (s.to(tl.float32) + x.to(tl.float32)).to(s.dtype)
    return s


@triton.jit
def _x_tile(
    x_ptrs, r_ptrs, ro_ptrs, nw_ptrs, x_mask, K, store_residual,
    GATED: tl.constexpr, NORMED: tl.constexpr, HAS_ADD: tl.constexpr,
):  # fmt: skip
    """(the GEMM's x^T tile [BLOCK_K, BLOCK_M], the tile the norm's squares come from): as
    loaded (plain); the SwiGLU of gate | up (GATED, rounded as silu_and_mul); or for the
    RMSNorm of s = residual (+ x) (NORMED): s times the norm's weight, s stored once to ro_ptrs.
    The norm's 1 / rms, a per-row scalar, scales the accumulator after the K loop."""
    if NORMED:
        s = _residual_sum(x_ptrs, r_ptrs, x_mask, HAS_ADD)
        if HAS_ADD:  # noqa: SIM102 (a constexpr, then a runtime test): one N tile stores the sum
            if store_residual:
                tl.store(ro_ptrs, s, mask=x_mask)
        nw = tl.load(nw_ptrs, mask=x_mask, other=0.0)  # x's tile shape: pipelined like x
        return (nw.to(tl.float32) * s.to(tl.float32)).to(s.dtype), s
    x = tl.load(x_ptrs, mask=x_mask, other=0.0)
    if GATED:  # x's row is gate | up (K each): silu(gate) * up, rounded as silu_and_mul
        up = tl.load(x_ptrs + K, mask=x_mask, other=0.0)
        g = x.to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(x.dtype)
        x = (act.to(tl.float32) * up.to(tl.float32)).to(up.dtype)
    return x, x


@triton.jit
def _skinny_gemm_kernel(
    y_ptr, x_ptr, w_ptr, bias_ptr, r_ptr, ro_ptr, nw_ptr, ws_ptr, eps, M, N, K, k_per_split,
    stride_xm, stride_wn, stride_ym, stride_rm, stride_rom,
    HAS_BIAS: tl.constexpr, GATED: tl.constexpr, NORMED: tl.constexpr, HAS_ADD: tl.constexpr,
    USE_DOT: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr, SPLIT_K: tl.constexpr, USE_PDL: tl.constexpr,
    PREFETCH_LINES: tl.constexpr, LINE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    pid_k = pid % SPLIT_K  # the split programs of one output tile are adjacent
    num_m_tiles = tl.cdiv(M, BLOCK_M)
    pid_n = pid // SPLIT_K // num_m_tiles
    pid_m = pid // SPLIT_K % num_m_tiles
    k_start = pid_k * k_per_split  # SPLIT_K == 1: 0, and k_per_split covers K
    k_stop = tl.minimum(K, k_start + k_per_split)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    rows = offs_m.to(tl.int64)[None, :]
    x_ptrs = x_ptr + rows * stride_xm + (k_start + offs_k)[:, None]  # [BK, BM]
    r_ptrs = r_ptr + rows * stride_rm + offs_k[:, None]  # [BK, BM] (NORMED only: no split)
    ro_ptrs = ro_ptr + rows * stride_rom + offs_k[:, None]
    nw_ptrs = nw_ptr + offs_k[:, None] + rows * 0  # [BK, BM]: the norm's weight, every row
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + (k_start + offs_k)[None, :]
    if PREFETCH_LINES > 0:  # PDL: W's first lines into L2 while the kernel before finishes
        pf_cols = tl.minimum(k_start + tl.arange(0, PREFETCH_LINES) * LINE, K - 1)
        pf_rows = tl.minimum(offs_n, N - 1).to(tl.int64)
        pdl.prefetch_l2(w_ptr + pf_rows[:, None] * stride_wn + pf_cols[None, :])
    pdl.wait_then_release(USE_PDL)  # x, the residual and y after the kernel before
    ssq = tl.zeros((BLOCK_K, BLOCK_M), dtype=tl.float32)  # NORMED: s^2, summed over K at the end
    if USE_DOT:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc3 = tl.zeros((BLOCK_N, BLOCK_M, BLOCK_K), dtype=tl.float32)
    for k0 in tl.range(k_start, k_stop, BLOCK_K, num_stages=NUM_STAGES):
        k_mask = offs_k < K - k0
        if EVEN_K:
            x_mask = mask_m[None, :]
            w = tl.load(w_ptrs, mask=mask_n[:, None], other=0.0)
        else:
            x_mask = mask_m[None, :] & k_mask[:, None]
            w = tl.load(w_ptrs, mask=mask_n[:, None] & k_mask[None, :], other=0.0)
        x, s = _x_tile(
            x_ptrs, r_ptrs, ro_ptrs, nw_ptrs, x_mask, K, pid_n == 0, GATED, NORMED, HAS_ADD
        )  # fmt: skip
        if NORMED:
            s = s.to(tl.float32)
            ssq += s * s  # no per-step reduction across threads (-50 us a b1 step)
        if UPCAST_DOT:  # the CPU interpreter's dot reads bf16 as raw uint16 bits
            acc = tl.dot(w.to(tl.float32), x.to(tl.float32), acc, input_precision="ieee")
        elif USE_DOT:
            acc = tl.dot(w, x, acc, input_precision=DOT_PRECISION)
        else:
            acc3 += w.to(tl.float32)[:, None, :] * tl.trans(x).to(tl.float32)[None, :, :]
        x_ptrs += BLOCK_K
        r_ptrs += BLOCK_K
        ro_ptrs += BLOCK_K
        nw_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if not USE_DOT:
        acc = tl.sum(acc3, axis=2)  # [BN, BM]
    if NORMED:  # as the norm kernel: 1 / sqrt(mean(s^2) + eps)
        acc = acc * (1.0 / tl.sqrt(tl.sum(ssq, axis=0) / K + eps))[None, :]
    out_mask = mask_n[:, None] & mask_m[None, :]
    if SPLIT_K > 1:  # the fp32 partial to ws [SPLIT_K, M, N]; _split_k_reduce_kernel finishes
        ws_ptrs = ws_ptr + (pid_k * M + offs_m.to(tl.int64))[None, :] * N + offs_n[:, None]
        tl.store(ws_ptrs, acc, mask=out_mask)
    else:
        if HAS_BIAS:
            bias = tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0)
            acc += bias.to(tl.float32)[:, None]
        y_ptrs = y_ptr + offs_m.to(tl.int64)[None, :] * stride_ym + offs_n[:, None]  # [BN, BM]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _split_k_reduce_kernel(
    y_ptr, ws_ptr, bias_ptr, M, N, stride_ym,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """y[m, n] = sum over s of ws[s, m, n] (+ bias[n]), in split order, rounded once."""
    pdl.wait_then_release(USE_PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    acc = tl.load(ws_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(ws_ptr + s * M * N + offs, mask=mask, other=0.0)
    n = offs % N
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs // N * stride_ym + n, acc.to(y_ptr.dtype.element_ty), mask=mask)


def skinny_linear(
    x: torch.Tensor,  # [M, K], K contiguous, 1 <= M <= MAX_M (M = 0 gives an empty result)
    weight: torch.Tensor,  # [N, K], K contiguous (nn.Linear's weight)
    bias: torch.Tensor | None = None,  # [N]
    config: SkinnyGemmConfig | None = None,  # None: skinny_gemm_config(M, N, K)
    *,
    gated: bool = False,  # x is [M, 2K], gate | up: the GEMM's input is silu(gate) * up
) -> torch.Tensor:  # [M, N], x's dtype
    """F.linear(x, weight, bias) in one Triton launch, fp32 accumulation, one rounding; gated:
    F.linear(silu_and_mul(x), weight, bias), the SwiGLU computed on the x tiles as they load
    (rounded where silu_and_mul rounds: the same values, one launch and no [M, K] buffer)."""
    if gated and (x.dim() != 2 or x.shape[-1] != 2 * weight.shape[-1]):
        raise ValueError(
            f"the gated skinny GEMM needs x [M, 2K] (gate | up) for weight [N, K]; got x "
            f"{tuple(x.shape)} and weight {tuple(weight.shape)}"
        )
    _check_inputs(x[:, : weight.shape[-1]] if gated else x, weight, bias)
    y = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
    _launch(y, x, weight, bias, config, gated=gated)
    return y


def skinny_norm_linear(
    x: torch.Tensor | None,  # [M, K]: added to the residual first; None: no add
    residual: torch.Tensor,  # [M, K], K contiguous
    norm_weight: torch.Tensor,  # [K]: the RMSNorm's weight, of residual's dtype
    eps: float,
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,
    config: SkinnyGemmConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # (y [M, N], the residual stream after the add)
    """F.linear(rms_norm(x + residual), weight, bias) and x + residual in ONE launch: the
    add_rms_norm kernel's work done on the GEMM's x tiles, in one pass over K. The norm's
    1 / rms is a per-row scalar, so it scales the accumulator after the K loop, where each
    row's sum of squares is complete: the GEMM's input is s * norm_weight rounded once, where
    add_rms_norm rounds s * (1 / rms) and then its product with the weight (a one-ulp-of-bf16
    difference in the input, not bitwise the two launches). The sum s = x + residual is rounded
    as add_rms_norm rounds it and goes to a new tensor (programs read residual while it is
    written); without x the residual is returned as it is."""
    _check_inputs(residual, weight, bias)
    k = residual.shape[1]
    if x is not None and (x.shape != residual.shape or x.dtype != residual.dtype):
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} must match the residual {residual.dtype}")
    if x is not None and x.shape[1] > 1 and x.stride(1) != 1:
        raise ValueError("skinny_norm_linear needs a contiguous K dim in x")
    if norm_weight.shape != (k,) or norm_weight.dtype != residual.dtype:
        raise ValueError(
            f"the norm's weight must be [K={k}] of the residual's dtype; got "
            f"{tuple(norm_weight.shape)} {norm_weight.dtype}"
        )
    summed = residual if x is None else torch.empty_like(residual)
    y = torch.empty(
        (residual.shape[0], weight.shape[0]), dtype=residual.dtype, device=residual.device
    )
    _launch(y, x, weight, bias, config, norm=(residual, summed, norm_weight.contiguous(), eps))
    return y, summed


def _launch(y, x, weight, bias, config, *, gated=False, norm=None) -> None:
    """One launch of the kernel into y; norm = (residual, summed out, norm weight, eps)."""
    m, n = y.shape
    k = weight.shape[1]
    if m == 0 or n == 0:
        return
    config = skinny_gemm_config(m, n, k) if config is None else config
    if norm is not None and config.split_k > 1:
        raise ValueError(f"the fused RMSNorm needs the whole of K in one program: {config.label()}")
    residual, summed, norm_weight, eps = norm if norm is not None else (y, y, y, 0.0)
    x = residual if x is None else x  # NORMED without the add reads only the residual
    precision = "ieee" if y.dtype == torch.float32 else "tf32"  # tf32 only ever applies to fp32
    upcast = config.use_dot and y.dtype == torch.bfloat16 and _INTERPRET
    split = config.split_k
    ws = torch.empty((split, m, n), dtype=torch.float32, device=y.device) if split > 1 else y
    line = pdl.L2_LINE_BYTES // weight.element_size()
    lines = pdl.prefetch_lines(m, config.block_n, config.k_per_split(k) * weight.element_size())
    _skinny_gemm_kernel[(config.num_programs(m, n),)](
        y, x, weight, weight if bias is None else bias, residual, summed, norm_weight, ws, eps,
        m, n, k, config.k_per_split(k),
        x.stride(0), weight.stride(0), y.stride(0), residual.stride(0), summed.stride(0),
        HAS_BIAS=bias is not None, GATED=gated, NORMED=norm is not None,
        HAS_ADD=norm is not None and summed is not residual,
        USE_DOT=config.use_dot, EVEN_K=k % config.block_k == 0,
        DOT_PRECISION=precision, UPCAST_DOT=upcast, SPLIT_K=split, PREFETCH_LINES=lines, LINE=line,
        BLOCK_M=config.tile_m(m), BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        NUM_STAGES=config.num_stages, num_warps=config.num_warps, num_stages=config.num_stages,
        **pdl.options(m),
    )  # fmt: skip
    if split > 1:
        _split_k_reduce_kernel[(triton.cdiv(m * n, _REDUCE_BLOCK),)](
            y, ws, weight if bias is None else bias, m, n, y.stride(0),
            HAS_BIAS=bias is not None, SPLIT_K=split, BLOCK=_REDUCE_BLOCK, **pdl.options(m),
        )  # fmt: skip


def _check_inputs(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"skinny_linear needs x [M, K] and weight [N, K]; got x {tuple(x.shape)} and "
            f"weight {tuple(weight.shape)}"
        )
    if x.dtype not in _DTYPES or weight.dtype != x.dtype:
        raise ValueError(
            f"skinny_linear needs x and weight of one dtype among float16, bfloat16, float32; "
            f"got {x.dtype} and {weight.dtype}"
        )
    if x.shape[0] > MAX_M:
        raise ValueError(
            f"skinny_linear takes at most {MAX_M} rows (tokens), got M={x.shape[0]}: "
            f"use F.linear (cuBLAS) above that"
        )
    if (x.shape[1] > 1 and x.stride(1) != 1) or (weight.shape[1] > 1 and weight.stride(1) != 1):
        raise ValueError(
            f"skinny_linear needs a contiguous K dim (stride 1) in x and weight; got strides "
            f"{x.stride()} and {weight.stride()}"
        )
    if x.device != weight.device:
        raise ValueError(f"x on {x.device} and weight on {weight.device}")
    if bias is None:
        return
    if bias.shape != (weight.shape[0],) or bias.dtype != x.dtype or bias.device != x.device:
        raise ValueError(
            f"skinny_linear needs bias [N={weight.shape[0]}] of x's dtype and device; got "
            f"{tuple(bias.shape)} {bias.dtype} on {bias.device}"
        )
    if bias.shape[0] > 1 and bias.stride(0) != 1:
        raise ValueError("skinny_linear needs a contiguous bias")
