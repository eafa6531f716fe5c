"""Programmatic dependent launch (PDL, sm_90+) for the Triton kernels of a decode step.

```
kernel N    | wait | release | ..................... work ........... | tail |
kernel N+1                    | launch | prefetch W -> L2 | wait ..... | work ...
```

Launched with `launch_pdl`, kernel N+1 is scheduled as soon as every program of kernel N has
passed `wait_then_release` (not when kernel N ends): its programs take the SMs that kernel N's
tail leaves idle, and the skinny GEMM prefetches the first columns of its weight slice into L2
there (weights are never written by an earlier kernel). Everything else a kernel reads or writes
comes after its `griddepcontrol.wait`, which returns once the kernel before it has completed and
its writes are visible: the stream order is kept for data, only the launch and the weight reads
overlap. A kernel that is not launched with PDL (cuBLAS, torch) waits for the whole of the one
before it, as always; the wait in a kernel launched without PDL returns at once. Kernels are
launched with PDL only while `enabled()` and only at MIN_TOKENS..MAX_TOKENS tokens (`options`); the
engine turns it on (PDSERVE_PDL, default on) on a GPU that has it, and the choice is made on the
host: a captured CUDA graph keeps it.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

L2_LINE_BYTES = 128  # one prefetch instruction per line
# Which launches go with PDL, by the launch's tokens (H100, llama3-8b bf16, CUDA graphs, in the
# engine: benchmarks/results/2026-12-05-h100-pdl.txt): one token measured slower with it (5.84
# -> 6.03 ms a step: short kernels, little tail to overlap) and 128 tokens too (12.88 -> 12.97);
# 2..64 tokens, with the skinny GEMM keeping the chain whole (CHAIN_WINS), 0.6-7% faster.
MIN_TOKENS = 2
MAX_TOKENS = 64


@dataclass
class _Settings:
    enabled: bool = False
    prefetch_bytes: int = 16 * 1024  # of W per skinny GEMM program


# Process-wide, like torch.backends flags: the engine's loader sets it for the model it loads.
_settings = _Settings()


def supported(capability: tuple[int, int]) -> bool:
    """Whether a GPU of this compute capability and this Triton can launch with PDL."""
    cuda = getattr(getattr(tl, "extra", None), "cuda", None)
    return capability >= (9, 0) and hasattr(cuda, "gdc_wait")


def set_enabled(on: bool, prefetch_bytes: int | None = None) -> None:
    """Launch the step's Triton kernels of MIN_TOKENS..MAX_TOKENS tokens with PDL (on) or all
    of them plainly; `prefetch_bytes`: how much of its weight slice a skinny GEMM program
    prefetches into L2 while it waits."""
    if prefetch_bytes is not None:
        if prefetch_bytes < 0:
            raise ValueError(f"prefetch_bytes must be >= 0, got {prefetch_bytes}")
        _settings.prefetch_bytes = prefetch_bytes
    _settings.enabled = bool(on)


def enabled() -> bool:
    return _settings.enabled


def uses_pdl(num_tokens: int) -> bool:
    """Whether a kernel over `num_tokens` tokens is launched with PDL (host-side, no sync: a
    captured CUDA graph keeps the choice of its batch size)."""
    return _settings.enabled and MIN_TOKENS <= num_tokens <= MAX_TOKENS


def options(num_tokens: int) -> dict[str, bool]:
    """The launch keywords of a kernel of the chain: its USE_PDL constexpr, and launch_pdl
    when it is launched with PDL (never passed otherwise: a Triton without PDL knows no such
    option)."""
    if uses_pdl(num_tokens):
        return {"USE_PDL": True, "launch_pdl": True}
    return {"USE_PDL": False}


def prefetch_bytes(num_tokens: int) -> int:
    """Bytes of W a skinny GEMM program prefetches before its wait (0 when launched plainly)."""
    return _settings.prefetch_bytes if uses_pdl(num_tokens) else 0


def prefetch_lines(num_tokens: int, rows: int, row_bytes: int) -> int:
    """128-byte lines of each of a program's `rows` weight rows (`row_bytes` of which it reads)
    to prefetch into L2 before its wait: the largest power of two within the prefetch budget
    (0 when launched plainly)."""
    per_row = min(prefetch_bytes(num_tokens) // rows, row_bytes)
    lines = per_row // L2_LINE_BYTES
    return 1 << (lines.bit_length() - 1) if lines else 0


@triton.jit
def wait_then_release(USE_PDL: tl.constexpr):
    """Wait until the kernel before has completed (its writes visible), then let the next
    kernel launch. Call it before the first load of anything an earlier kernel may write."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs):
    """Ask for the 128-byte lines at `ptrs` to be brought into L2 (no registers, no wait)."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1]; // $0 unused",
        "=r,l",
        [ptrs],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )
