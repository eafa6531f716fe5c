"""A keyed digest of a KV payload computed where the payload lives (the KV hand-off's frame
MAC for GPU payloads: cache_transfer/frame_auth). The Triton kernel on CUDA, the torch
reference elsewhere; both give the same bits."""

from __future__ import annotations

import torch

from kernels.kv_digest.reference import (
    CHUNK_WORDS,
    LANES,
    PRIME,
    digest_reference,
    num_chunks,
)
from kernels.kv_digest.triton_digest import digest_triton, triton_available


def kv_digest(payload: torch.Tensor, key: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """`[num_chunks, LANES]` int32 on the payload's device (reference.py defines it). `impl`:
    "auto" (Triton on CUDA, torch elsewhere), "triton" or "torch"."""
    if impl == "auto":
        impl = "triton" if payload.is_cuda and triton_available() else "torch"
    if impl == "triton":
        return digest_triton(payload, key)
    if impl == "torch":
        return digest_reference(payload, key)
    raise ValueError(f"impl must be auto, triton or torch, got {impl!r}")


__all__ = ["CHUNK_WORDS", "LANES", "PRIME", "kv_digest", "num_chunks"]
