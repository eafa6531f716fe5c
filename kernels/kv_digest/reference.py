"""The torch reference of the KV payload digest (any device; the CPU path, and what the Triton
kernel is tested against).

    digest_reference(payload, key) -> [num_chunks, LANES] int32

`payload`: flat uint8, an even number of bytes, read as little-endian 16-bit words w_i (values
in [0, 2^16)); `key`: int64 `[LANES, CHUNK_WORDS]`, each word in [0, PRIME). Chunk c of the
payload is words [c * CHUNK_WORDS, (c + 1) * CHUNK_WORDS), the last one zero-padded, and its
digest in lane t is

    d[c, t] = (sum_i w[c * CHUNK_WORDS + i] * key[t, i]) mod PRIME

a multilinear hash over Z_p (p = 2^31 - 1). Every product is below 2^47 and a chunk's sum below
2^60: exact in int64, so every device computes the same digest bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PRIME = (1 << 31) - 1  # a Mersenne prime: every 16-bit word and every difference of two is a unit
LANES = 4  # independent keys: a collision in one chunk has probability <= (2 / 2^31)^LANES
CHUNK_WORDS = 8192  # 16 KiB of payload per digest row (key: LANES x CHUNK_WORDS words)


def check_digest_inputs(payload: torch.Tensor, key: torch.Tensor) -> int:
    """The number of 16-bit words in `payload`; ValueError when an input is malformed."""
    if payload.dtype != torch.uint8 or payload.dim() != 1 or not payload.is_contiguous():
        raise ValueError(
            f"payload must be flat contiguous uint8, got {payload.dtype} {payload.shape}"
        )
    if payload.numel() % 2:
        raise ValueError(f"payload has {payload.numel()} bytes; the digest reads 16-bit words")
    if key.dtype != torch.int64 or tuple(key.shape) != (LANES, CHUNK_WORDS):
        raise ValueError(f"key must be int64 [{LANES}, {CHUNK_WORDS}], got {key.dtype} {key.shape}")
    if key.device != payload.device:
        raise ValueError(f"key on {key.device}, payload on {payload.device}")
    return payload.numel() // 2


def num_chunks(num_bytes: int) -> int:
    """Digest rows for a payload of `num_bytes` (at least one)."""
    return max(1, -(-(num_bytes // 2) // CHUNK_WORDS))


def digest_reference(payload: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    num_words = check_digest_inputs(payload, key)
    rows = num_chunks(payload.numel())
    words = payload.view(torch.int16).to(torch.int64) & 0xFFFF  # [num_words]
    words = F.pad(words, (0, rows * CHUNK_WORDS - num_words)).view(rows, CHUNK_WORDS)
    lanes = [(words * key[lane]).sum(dim=1) % PRIME for lane in range(LANES)]  # [rows] each
    return torch.stack(lanes, dim=1).to(torch.int32)  # [rows, LANES]
