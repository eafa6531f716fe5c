"""The KV payload digest in one Triton launch (the reference: reference.py, same definition).

    digest_triton(payload, key) -> [num_chunks, LANES] int32

One program per chunk of CHUNK_WORDS 16-bit words: it reads its 16 KiB once, multiplies each
word by the LANES key words of its position (int64: every product < 2^47, a chunk's sum
< 2^60, so the sums are exact) and reduces each lane mod PRIME. The key (LANES x CHUNK_WORDS
int64, 256 KiB) is read by every program and stays in L2.
"""

from __future__ import annotations

import torch

from kernels.kv_digest.reference import (
    CHUNK_WORDS,
    LANES,
    PRIME,
    check_digest_inputs,
    num_chunks,
)

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships with torch on x86_64 Linux
    triton = None

BLOCK = 1024  # words a program multiplies per iteration


def triton_available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _digest_chunks(
        words_ptr, key_ptr, out_ptr, num_words,
        CHUNK: tl.constexpr, BLOCK: tl.constexpr, P: tl.constexpr,
    ):  # fmt: skip
        chunk = tl.program_id(0)
        acc0 = tl.zeros([BLOCK], dtype=tl.int64)
        acc1 = tl.zeros([BLOCK], dtype=tl.int64)
        acc2 = tl.zeros([BLOCK], dtype=tl.int64)
        acc3 = tl.zeros([BLOCK], dtype=tl.int64)
        for start in range(0, CHUNK, BLOCK):
            offs = start + tl.arange(0, BLOCK)  # position in the chunk (the key's index)
            pos = chunk.to(tl.int64) * CHUNK + offs
            w = tl.load(words_ptr + pos, mask=pos < num_words, other=0).to(tl.int64) & 0xFFFF
            acc0 += w * tl.load(key_ptr + offs)
            acc1 += w * tl.load(key_ptr + CHUNK + offs)
            acc2 += w * tl.load(key_ptr + 2 * CHUNK + offs)
            acc3 += w * tl.load(key_ptr + 3 * CHUNK + offs)
        base = out_ptr + chunk * 4
        tl.store(base, (tl.sum(acc0, axis=0) % P).to(tl.int32))
        tl.store(base + 1, (tl.sum(acc1, axis=0) % P).to(tl.int32))
        tl.store(base + 2, (tl.sum(acc2, axis=0) % P).to(tl.int32))
        tl.store(base + 3, (tl.sum(acc3, axis=0) % P).to(tl.int32))


def digest_triton(payload: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    num_words = check_digest_inputs(payload, key)
    if triton is None:
        raise RuntimeError("triton is not installed")
    assert LANES == 4  # the kernel's four accumulators
    rows = num_chunks(payload.numel())
    out = torch.empty((rows, LANES), dtype=torch.int32, device=payload.device)
    words = payload.view(torch.int16)
    _digest_chunks[(rows,)](words, key, out, num_words, CHUNK=CHUNK_WORDS, BLOCK=BLOCK, P=PRIME)
    return out
