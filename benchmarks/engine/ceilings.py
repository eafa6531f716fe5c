"""What `pd-bench engine` measures against, measured in the same run, and the work a step does.

```
memory_bandwidth(device)      copy of a large buffer: (bytes read + bytes written) / time
gemm_rate(device, dtype)      one square matmul: 2 n^3 / time
decode_bytes(model, ...)      bytes a decode step must read: every weight once (the embedding
                              table only through the LM head), plus each request's KV context
prefill_flops(model, ...)     2 * weights * tokens (linear layers, LM head on the last token)
                              + causal attention 4 * head_dim * heads per visible query-key pair
```
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from engine.model.arch_config import ModelArchConfig


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_best(fn: Callable[[], object], device: torch.device, iters: int) -> float:
    """The fastest of `iters` runs of fn, in seconds (after one warm-up run)."""
    fn()
    _sync(device)
    best = float("inf")
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def memory_bandwidth(device: torch.device, num_bytes: int, iters: int = 10) -> float:
    """Copy bandwidth in bytes/s, read + write counted (the HBM ceiling on a GPU)."""
    src = torch.empty(num_bytes // 2, dtype=torch.int16, device=device).fill_(1)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 2 / time_best(lambda: dst.copy_(src), device, iters)


def gemm_rate(device: torch.device, dtype: torch.dtype, n: int, iters: int = 10) -> float:
    """FLOP/s of an n x n x n matmul in `dtype`."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    return 2 * n**3 / time_best(lambda: a @ b, device, iters)


def weight_bytes(model: torch.nn.Module, arch: ModelArchConfig) -> int:
    """Bytes of the weights a decode step reads: all but the embedding table (only a few of
    its rows are read), which counts once when it doubles as the LM head."""
    total = 0
    for name, param in model.named_parameters():
        if name.endswith("embed_tokens.weight") and not arch.tie_word_embeddings:
            continue
        total += param.numel() * param.element_size()
    return total


def kv_bytes_per_token(arch: ModelArchConfig, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * elem


def decode_bytes(
    model: torch.nn.Module, arch: ModelArchConfig, dtype: torch.dtype, batch: int, context: int
) -> int:
    """Bytes one decode step of `batch` requests at `context` tokens must read."""
    return weight_bytes(model, arch) + batch * context * kv_bytes_per_token(arch, dtype)


def prefill_flops(model: torch.nn.Module, arch: ModelArchConfig, num_tokens: int) -> float:
    """FLOPs of one prompt of `num_tokens` (no cached prefix), sampling its last token."""
    linear = sum(
        p.numel()
        for name, p in model.named_parameters()
        if p.dim() == 2 and "embed_tokens" not in name and "lm_head" not in name
    )
    lm_head = arch.vocab_size * arch.hidden_size
    pairs = num_tokens * (num_tokens + 1) / 2
    attention = 4 * arch.head_dim * arch.num_heads * pairs * arch.num_layers
    return 2 * linear * num_tokens + 2 * lm_head + attention
