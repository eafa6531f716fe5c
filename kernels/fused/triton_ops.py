"""Triton kernels of the fused per-layer ops: one launch each for the residual add + RMSNorm,
rotary on q and k together, and SwiGLU.

```
add_rms_norm  grid (T,):          s = x + residual (rounded to the dtype, stored in residual),
                                  out = weight * (s * rsqrt(mean(s^2) + eps)) in float32 math
rms_norm      grid (T,):          the same without the add
rotary_qk     grid (T, H + KVH):  q and k rotated in place (rotate-half), cos/sin rows of the step;
                                  with caches (rotary_qk_write_kv) the k programs also store the
                                  rotated k and v at the token's slot (the KV-cache write)
silu_and_mul  grid (T, cdiv(d, BLOCK)): silu(gate) * up
```

The intermediate roundings follow the torch reference (`reference.py`) step by step, so in
float16/bfloat16 results match it up to the order of the norm's sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl

_MAX_NORM_DIM = 1 << 16  # one program holds a whole row
_ACT_BLOCK = 1024  # SwiGLU elements per program


@triton.jit
def _rms_norm_kernel(
    out_ptr, x_ptr, residual_ptr, weight_ptr, eps, n_cols,
    stride_out, stride_x, stride_res,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl.wait_then_release(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        res = tl.load(residual_ptr + row * stride_res + cols, mask=mask, other=0.0)
        x = (res.to(tl.float32) + x.to(tl.float32)).to(x.dtype)
        tl.store(residual_ptr + row * stride_res + cols, x, mask=mask)
    xf = x.to(tl.float32)
    variance = tl.sum(xf * xf, axis=0) / n_cols
    normed = (xf * (1.0 / tl.sqrt(variance + eps))).to(x.dtype)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = (w.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_out + cols, out, mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _norm_block(n_cols: int) -> int:
    if n_cols > _MAX_NORM_DIM:
        raise ValueError(f"rms_norm rows of {n_cols} > {_MAX_NORM_DIM} elements")
    return triton.next_power_of_2(n_cols)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of any [..., d] tensor (a new contiguous tensor)."""
    rows = _rows(x)
    return _launch_norm(rows, None, weight, eps).view(x.shape)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one kernel; the sum is written into
    `residual` (which must be a contiguous [T, d] tensor nobody else reads)."""
    if residual.dim() != 2 or residual.stride(-1) != 1 or x.shape != residual.shape:
        raise ValueError(
            f"add_rms_norm needs x and residual of one [T, d] shape with a contiguous last dim; "
            f"got {tuple(x.shape)} and {tuple(residual.shape)}"
        )
    return _launch_norm(_rows(x), residual, weight, eps), residual


def _launch_norm(
    rows: torch.Tensor,  # [T, d], contiguous last dim
    residual: torch.Tensor | None,  # [T, d]: rows are added into it first, in place
    weight: torch.Tensor,
    eps: float,
) -> torch.Tensor:  # [T, d] normed, a new tensor
    out = torch.empty(rows.shape, dtype=torch.result_type(rows, weight), device=rows.device)
    n_rows, n_cols = rows.shape
    if n_rows:
        block = _norm_block(n_cols)
        res = rows if residual is None else residual
        _rms_norm_kernel[(n_rows,)](
            out, rows, res, weight, eps, n_cols, out.stride(0), rows.stride(0), res.stride(0),
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=_norm_warps(block),
            **pdl.options(n_rows),
        )  # fmt: skip
    return out


def _norm_warps(block: int) -> int:
    return min(max(block // 256, 1), 16)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, scale_ptr,
    num_q_heads, num_kv_heads,
    stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
    stride_cos, stride_sin, stride_cache_slot, stride_cache_head,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, WRITE_KV: tl.constexpr, FP8: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl.wait_then_release(USE_PDL)
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    is_k = head >= num_q_heads
    kv_head = head - num_q_heads  # meaningful for k programs only
    if is_k:
        base = k_ptr + tok * stride_k_tok + kv_head * stride_k_head
    else:
        base = q_ptr + tok * stride_q_tok + head * stride_q_head
    offs = tl.arange(0, HALF_PAD)
    mask = offs < HALF
    x1 = tl.load(base + offs, mask=mask, other=0.0)
    x2 = tl.load(base + HALF + offs, mask=mask, other=0.0)
    cos = tl.load(cos_ptr + tok * stride_cos + offs, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + tok * stride_sin + offs, mask=mask, other=0.0).to(tl.float32)
    dt = x1.dtype
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    # Each product rounded to the dtype, then the sum: the reference's order of roundings.
    o1 = ((x1f * cos).to(dt).to(tl.float32) - (x2f * sin).to(dt).to(tl.float32)).to(dt)
    o2 = ((x2f * cos).to(dt).to(tl.float32) + (x1f * sin).to(dt).to(tl.float32)).to(dt)
    tl.store(base + offs, o1, mask=mask)
    tl.store(base + HALF + offs, o2, mask=mask)
    if WRITE_KV:  # noqa: SIM102 (a compile-time branch around a runtime one)
        if is_k:
            slot = tl.load(slot_ptr + tok).to(tl.int64)
            cache_offs = slot * stride_cache_slot + kv_head * stride_cache_head
            v_base = v_ptr + tok * stride_v_tok + kv_head * stride_v_head
            v1 = tl.load(v_base + offs, mask=mask, other=0.0)
            v2 = tl.load(v_base + HALF + offs, mask=mask, other=0.0)
            k_ptrs = k_cache_ptr + cache_offs
            v_ptrs = v_cache_ptr + cache_offs
            if FP8:  # x / scale of its head, saturated, rounded to e4m3 (kv_quant.quantize)
                k_scale = tl.load(scale_ptr + kv_head)
                v_scale = tl.load(scale_ptr + num_kv_heads + kv_head)
                tl.store(k_ptrs + offs, _to_fp8(o1, k_scale, k_cache_ptr), mask=mask)
                tl.store(k_ptrs + HALF + offs, _to_fp8(o2, k_scale, k_cache_ptr), mask=mask)
                tl.store(v_ptrs + offs, _to_fp8(v1, v_scale, k_cache_ptr), mask=mask)
                tl.store(v_ptrs + HALF + offs, _to_fp8(v2, v_scale, k_cache_ptr), mask=mask)
            else:
                tl.store(k_ptrs + offs, o1, mask=mask)
                tl.store(k_ptrs + HALF + offs, o2, mask=mask)
                tl.store(v_ptrs + offs, v1, mask=mask)
                tl.store(v_ptrs + HALF + offs, v2, mask=mask)


@triton.jit
def _to_fp8(x, scale, cache_ptr):
    scaled = x.to(tl.float32) / scale
    scaled = tl.minimum(tl.maximum(scaled, -448.0), 448.0)
    return scaled.to(cache_ptr.dtype.element_ty, fp_downcast_rounding="rtne")


def _check_last_dim(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.stride(-1) != 1:
            raise ValueError("rotary_qk needs a contiguous last dim for q, k, v, cos and sin")


def rotary_qk(
    q: torch.Tensor,  # [T, H, D], head_dim contiguous (a view of the fused QKV output is fine)
    k: torch.Tensor,  # [T, KVH, D]
    cos: torch.Tensor,  # [T, 1, D // 2] (any token stride, contiguous last dim)
    sin: torch.Tensor,  # [T, 1, D // 2]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k in place, one launch for both; returns (q, k)."""
    _check_last_dim(q, k, cos, sin)
    _launch_rotary(q, k, k, cos, sin, k, k, k, 1, 0, write_kv=False)
    return q, k


def rotary_qk_write_kv(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,  # [T, KVH, D]
    cos: torch.Tensor,  # [T, 1, D // 2]
    sin: torch.Tensor,  # [T, 1, D // 2]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64
    kv_scales: torch.Tensor | None = None,  # [2, KVH] float32: an FP8 cache's scales
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k in place and store the rotated k and v at their cache slots (quantized
    in an FP8 cache): one launch for the rotary and the KV-cache write. Returns (q, k)."""
    _check_last_dim(q, k, v, cos, sin)
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache need the same strides and a contiguous head_dim")
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if fp8 and (kv_scales is None or not kv_scales.is_contiguous()):
        raise ValueError("an FP8 KV cache needs its kv_scales ([2, num_kv_heads], contiguous)")
    slots = k_cache.view(-1, *k_cache.shape[2:])  # [num_slots, KVH, D]: fails if not a view
    _launch_rotary(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, slots.stride(0),
                   slots.stride(1), write_kv=True, kv_scales=kv_scales if fp8 else None)  # fmt: skip
    return q, k


def _launch_rotary(q, k, v, cos, sin, k_cache, v_cache, slots, stride_slot, stride_head, write_kv,
                   kv_scales=None):  # fmt: skip
    num_tokens, num_q_heads, head_dim = q.shape
    half = head_dim // 2
    scales = k_cache if kv_scales is None else kv_scales  # (unread unless FP8)
    if num_tokens:
        _rotary_kernel[(num_tokens, num_q_heads + k.shape[1])](
            q, k, v, cos, sin, k_cache, v_cache, slots, scales, num_q_heads, k.shape[1],
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            cos.stride(0), sin.stride(0), stride_slot, stride_head,
            HALF=half, HALF_PAD=triton.next_power_of_2(half), WRITE_KV=write_kv,
            FP8=kv_scales is not None, num_warps=1, **pdl.options(num_tokens),
        )  # fmt: skip


@triton.jit
def _silu_and_mul_kernel(
    out_ptr, x_ptr, d, stride_out, stride_x, BLOCK: tl.constexpr, USE_PDL: tl.constexpr
):  # fmt: skip
    pdl.wait_then_release(USE_PDL)
    tok = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + tok * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + tok * stride_x + d + cols, mask=mask, other=0.0)
    dt = gate.dtype
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(dt)
    out = (act.to(tl.float32) * up.to(tl.float32)).to(dt)
    tl.store(out_ptr + tok * stride_out + cols, out, mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU on the fused gate|up projection: [T, 2 * d] -> [T, d], one launch."""
    x = _rows(gate_up)
    num_tokens, d = x.shape[0], x.shape[1] // 2
    out = torch.empty(num_tokens, d, dtype=x.dtype, device=x.device)
    if num_tokens:
        block = min(_ACT_BLOCK, triton.next_power_of_2(d))
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(d, block))](
            out, x, d, out.stride(0), x.stride(0), BLOCK=block, num_warps=4,
            **pdl.options(num_tokens),
        )  # fmt: skip
    return out.view(*gate_up.shape[:-1], d)
