"""Pick an attention backend by name, or the fastest one that fits ("auto").

```
auto on CUDA: flash_attn (installed, fp16/bf16, block_size % 256 == 0, KV not FP8) > triton
              (installed) > torch
auto on CPU:  torch (bf16/fp16: its decode rows on the C++ kernel, cpu_paged_decode.py)
```

Backends that need optional packages (triton, flash_attn) are imported only when chosen, so
importing `kernels.attention` stays cheap.
"""

from __future__ import annotations

import importlib
import importlib.util

import torch

from kernels.attention import cpu_paged_decode
from kernels.attention.backend import AttentionBackend

BACKEND_NAMES = ("auto", "torch", "triton", "flash_attn")
FLASH_ATTN_BLOCK_SIZE = 256  # FA2's paged KV needs a block size that is a multiple of it

# name -> (module of the backend class, class name, the package it needs or None)
_BACKENDS: dict[str, tuple[str, str, str | None]] = {
    "torch": ("kernels.attention.torch_backend", "TorchAttentionBackend", None),
    "triton": ("kernels.attention.triton_backend", "TritonAttentionBackend", "triton"),
    "flash_attn": ("kernels.attention.flash_attn_backend", "FlashAttnBackend", "flash_attn"),
}


def get_attention_backend(
    name: str,
    device: torch.device,
    dtype: torch.dtype,
    block_size: int,
    cpu_decode_kernel: bool = True,
    kv_cache_dtype: str = "auto",
) -> AttentionBackend:
    """A backend instance for `name` ("auto" | "torch" | "triton" | "flash_attn"). The torch
    backend on CPU in bf16/fp16 takes the C++ decode kernel (cpu_paged_decode.py) when
    `cpu_decode_kernel` and it builds.

    `kv_cache_dtype` "fp8_e4m3": only backends that read FP8 blocks (not flash_attn).

    Raises ValueError saying why when the named backend cannot run here, and what to use.
    """
    device = torch.device(device)
    resolved = resolve_backend_name(name, device, dtype, block_size, kv_cache_dtype)
    backend = _load(resolved)
    if resolved != "torch":
        return backend()
    use_kernel = (
        cpu_decode_kernel
        and device.type == "cpu"
        and dtype in (torch.bfloat16, torch.float16)
        and cpu_paged_decode.available()
    )
    return backend(cpu_decode_kernel=use_kernel)  # type: ignore[call-arg]


def resolve_backend_name(
    name: str, device: torch.device, dtype: torch.dtype, block_size: int,
    kv_cache_dtype: str = "auto",
) -> str:  # fmt: skip
    """The concrete backend name `name` stands for here; ValueError if it cannot run."""
    if name == "auto":
        return _auto_name(device, dtype, block_size, kv_cache_dtype)
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {BACKEND_NAMES}")
    reason = unavailable_reason(name, device, dtype, block_size, kv_cache_dtype)
    if reason is not None:
        fallback = _auto_name(device, dtype, block_size, kv_cache_dtype)
        raise ValueError(
            f"attention backend {name!r} cannot run here: {reason}; "
            f"use {fallback!r} (or 'auto') instead"
        )
    return name


def unavailable_reason(
    name: str, device: torch.device, dtype: torch.dtype, block_size: int,
    kv_cache_dtype: str = "auto",
) -> str | None:  # fmt: skip
    """Why backend `name` cannot run with these settings, or None if it can."""
    _, _, package = _BACKENDS[name]
    if package is None:
        return None
    if name == "flash_attn" and kv_cache_dtype != "auto":
        return (
            f"the flash_attn backend does not read a {kv_cache_dtype} KV cache "
            "(--kv-cache-dtype fp8_e4m3 runs on the triton and torch backends)"
        )
    if device.type != "cuda":
        return f"it needs a CUDA device (got {device})"
    if name == "flash_attn" and dtype not in (torch.float16, torch.bfloat16):
        return f"flash-attn needs float16 or bfloat16 (got {dtype})"
    if name == "flash_attn" and block_size % FLASH_ATTN_BLOCK_SIZE != 0:
        return (
            f"flash-attn paged KV needs block_size % {FLASH_ATTN_BLOCK_SIZE} == 0 "
            f"(got {block_size})"
        )
    if name == "triton" and dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"the triton kernels support float16, bfloat16 and float32 (got {dtype})"
    if not is_installed(package):
        return f"the {package!r} package is not installed"
    return None


def is_installed(package: str) -> bool:
    """Whether `package` can be imported (without importing it)."""
    return importlib.util.find_spec(package) is not None


def _auto_name(
    device: torch.device, dtype: torch.dtype, block_size: int, kv_cache_dtype: str = "auto"
) -> str:
    for name in ("flash_attn", "triton"):
        if unavailable_reason(name, device, dtype, block_size, kv_cache_dtype) is None:
            return name
    return "torch"


def _load(name: str) -> type[AttentionBackend]:
    module_name, class_name, package = _BACKENDS[name]
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(
            f"attention backend {name!r} failed to import ({exc}); "
            f"check the {package!r} installation or use 'torch'"
        ) from exc
    return getattr(module, class_name)
