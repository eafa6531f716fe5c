"""FP8 KV cache values: the storage dtype a `--kv-cache-dtype` stands for, and the torch
quantize / dequantize every path (write, read, tests) shares.

```
store:  cache = saturate(x / scale[head]).to(float8_e4m3fn)      (|x / scale| > 448 -> +-448)
read:   x ~= cache.to(dtype) * scale[head]
scales: [num_layers, 2 (K, V), num_kv_heads] float32, fixed for the pool's life (KVCachePool)
```
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
KV_CACHE_DTYPE_NAMES = {"fp8_e4m3": FP8_DTYPE}


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache tensors' dtype: the model's for "auto", else the named FP8 dtype."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in KV_CACHE_DTYPE_NAMES:
        raise ValueError(
            f"unknown kv_cache_dtype {kv_cache_dtype!r}; choose auto or "
            f"{', '.join(KV_CACHE_DTYPE_NAMES)}"
        )
    return KV_CACHE_DTYPE_NAMES[kv_cache_dtype]


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == FP8_DTYPE


def quantize(
    x: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    scale: torch.Tensor,  # [num_kv_heads] float32
) -> torch.Tensor:  # [num_tokens, num_kv_heads, head_dim] float8_e4m3fn
    """`x / scale` per head, saturated to the FP8 range, in FP8 (rounded to nearest)."""
    scaled = x.float() / scale[:, None]
    return scaled.clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize(
    cache: torch.Tensor,  # [..., num_kv_heads, head_dim] float8_e4m3fn
    scale: torch.Tensor,  # [num_kv_heads] float32
    dtype: torch.dtype,
) -> torch.Tensor:  # [..., num_kv_heads, head_dim] in dtype
    """The values `quantize` stored, in `dtype`."""
    return (cache.float() * scale[:, None]).to(dtype)


def unit_scales(
    num_layers: int, num_kv_heads: int, device: torch.device
) -> torch.Tensor:  # [num_layers, 2, num_kv_heads] float32
    """The fixed scales: 1.0 for every layer, K/V and KV head (engine/README.md, "FP8 KV
    cache", says why fixed)."""
    return torch.ones(num_layers, 2, num_kv_heads, dtype=torch.float32, device=device)
