"""The torch reference of the fused per-layer ops: the CPU path, and what the Triton kernels
are tested against.

Each op computes exactly what the unfused Llama layer computed (same dtype casts in the same
order), so a model on these ops gives bit-identical results to the plain module code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.attention.torch_backend import write_kv_cache


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim in float32 (as Hugging Face's LlamaRMSNorm): [..., d]."""
    x_fp32 = x.float()
    variance = x_fp32.pow(2).mean(-1, keepdim=True)
    return weight * (x_fp32 * torch.rsqrt(variance + eps)).to(x.dtype)


def add_rms_norm(
    x: torch.Tensor,  # [T, d]
    residual: torch.Tensor,  # [T, d]
    weight: torch.Tensor,  # [d]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # (rms_norm(x + residual), x + residual)
    """The residual add and the next norm: returns (normed, new residual)."""
    summed = residual + x
    return rms_norm(summed, weight, eps), summed


def rotary_qk(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D]
    cos: torch.Tensor,  # [T, 1, D // 2], in q's dtype
    sin: torch.Tensor,  # [T, 1, D // 2]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half rotary on q and k (new tensors)."""
    return rotary(q, cos, sin), rotary(k, cos, sin)


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
    """Rotary on q and k, then the rotated k and v stored at their cache slots (what the
    attention backend's write would store; quantized in an FP8 cache). Returns (q, k)
    rotated."""
    q, k = rotary_qk(q, k, cos, sin)
    write_kv_cache(k, v, k_cache, v_cache, slot_mapping, kv_scales)
    return q, k


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary of one [T, heads, D] tensor: (x1 * cos - x2 * sin, x2 * cos + x1 * sin)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU on the fused gate|up projection: [..., 2 * d] -> [..., d]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
