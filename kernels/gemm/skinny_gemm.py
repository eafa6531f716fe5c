"""The skinny GEMM: y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for few tokens (M <= 128) in ONE
Triton launch, streaming W (the nn.Linear layout, K contiguous) once from HBM.

```
grid (cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N),)   the M tiles of one N tile are adjacent programs
program: acc[BLOCK_N, BLOCK_M] fp32 = sum over K, BLOCK_K at a time, of W tile . x tile^T
         (+ bias), rounded once to the dtype, stored transposed into y [M, N]
dot path  (M padded to >= 16): acc += tl.dot(W [BLOCK_N, BLOCK_K], x^T [BLOCK_K, BLOCK_M])
          W is the mma's A operand ("swap AB"): BLOCK_N is its wide dim, the tokens its narrow one
          (mma.sync m16n8k16 for small tiles; wgmma once BLOCK_N >= 64 and BLOCK_M >= 64)
fma path  (tiny M, no padding): acc3[BLOCK_N, BLOCK_M, BLOCK_K] += W * x in fp32, summed over K
          once after the loop (no per-step shuffles)
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
programs. It does not split K: the N tiles alone fill the GPU for the llama3-8b shapes (a
4096-row W in 16-row tiles is 256 programs for 132 SMs), so there is no second reduce launch,
no workspace, no atomics, and each output is one program's sum in one fixed order: bitwise
deterministic from run to run. The launch comes from `skinny_gemm_config`'s table (host-side,
no autotuning, no sync: CUDA-graph safe).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.gemm.skinny_config import MAX_M, SkinnyGemmConfig, measured_win, skinny_gemm_config

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Triton's CPU interpreter (the unit tests) multiplies bfloat16 tiles as their raw uint16 bits:
# there, and only there, the dot path converts bfloat16 tiles to float32 first.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _skinny_gemm_kernel(
    y_ptr, x_ptr, w_ptr, bias_ptr, M, N, K,
    stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, USE_DOT: tl.constexpr, EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    num_m_tiles = tl.cdiv(M, BLOCK_M)
    pid_n = pid // num_m_tiles
    pid_m = pid % num_m_tiles
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_ptrs = x_ptr + offs_m.to(tl.int64)[None, :] * stride_xm + offs_k[:, None]  # [BK, BM]
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]  # [BN, BK]
    if USE_DOT:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc3 = tl.zeros((BLOCK_N, BLOCK_M, BLOCK_K), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=mask_m[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=mask_n[:, None], other=0.0)
        else:
            x = tl.load(x_ptrs, mask=mask_m[None, :] & (offs_k[:, None] < K - k0), other=0.0)
            w = tl.load(w_ptrs, mask=mask_n[:, None] & (offs_k[None, :] < K - k0), other=0.0)
        if UPCAST_DOT:  # the CPU interpreter's dot reads bf16 as raw uint16 bits
            acc = tl.dot(w.to(tl.float32), x.to(tl.float32), acc, input_precision="ieee")
        elif USE_DOT:
            acc = tl.dot(w, x, acc, input_precision=DOT_PRECISION)
        else:
            acc3 += w.to(tl.float32)[:, None, :] * tl.trans(x).to(tl.float32)[None, :, :]
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if not USE_DOT:
        acc = tl.sum(acc3, axis=2)  # [BN, BM]
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0)
        acc += bias.to(tl.float32)[:, None]
    y_ptrs = y_ptr + offs_m.to(tl.int64)[None, :] * stride_ym + offs_n[:, None]  # [BN, BM]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_n[:, None] & mask_m[None, :])


def skinny_linear(
    x: torch.Tensor,  # [M, K], K contiguous, 1 <= M <= MAX_M (M = 0 gives an empty result)
    weight: torch.Tensor,  # [N, K], K contiguous (nn.Linear's weight)
    bias: torch.Tensor | None = None,  # [N]
    config: SkinnyGemmConfig | None = None,  # None: skinny_gemm_config(M, N, K)
) -> torch.Tensor:  # [M, N], x's dtype
    """F.linear(x, weight, bias) in one Triton launch, fp32 accumulation, one rounding."""
    _check_inputs(x, weight, bias)
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    config = skinny_gemm_config(m, n, k) if config is None else config
    block_m = config.tile_m(m)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # tf32 only ever applies to fp32
    upcast = config.use_dot and x.dtype == torch.bfloat16 and _INTERPRET
    _skinny_gemm_kernel[(config.num_programs(m, n),)](
        y, x, weight, weight if bias is None else bias, m, n, k,
        x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, USE_DOT=config.use_dot, EVEN_K=k % config.block_k == 0,
        DOT_PRECISION=precision, UPCAST_DOT=upcast,
        BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        NUM_STAGES=config.num_stages, num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return y


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


def routed_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, max_m: int
) -> torch.Tensor:
    """nn.Linear's projection: the skinny GEMM for 1..max_m rows of float16/bfloat16 with
    contiguous K where it measured faster than cuBLAS for this very (M, N, K) (`measured_win`),
    else F.linear (cuBLAS). The choice is on shapes and dtypes only (host-side, CUDA-graph
    safe: a captured batch size always takes the same path)."""
    m = x.shape[0] if x.dim() == 2 else 0
    if (
        1 <= m <= max_m
        and x.dtype in (torch.float16, torch.bfloat16)
        and x.stride(-1) == 1
        and weight.stride(-1) == 1
    ):
        config = measured_win(m, weight.shape[0], weight.shape[1])
        if config is not None:
            return skinny_linear(x, weight, bias, config)
    return F.linear(x, weight, bias)
