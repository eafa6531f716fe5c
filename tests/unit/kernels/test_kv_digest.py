"""The KV payload digest (kernels/kv_digest; the GPU frame MAC's keyed hash, issue 39): the
torch reference against the definition written out with Python integers, its keyed-hash
properties, and the Triton kernel against the reference on CPU through Triton's interpreter (in
a subprocess: the interpreter is chosen when the kernel is decorated). tests/gpu runs it
compiled at llama3-8b sizes."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from kernels.kv_digest import CHUNK_WORDS, LANES, PRIME, kv_digest, num_chunks
from tests.child_env import child_env


def _key(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, PRIME, (LANES, CHUNK_WORDS), dtype=torch.int64, generator=gen)


def _definition(payload: bytes, key: torch.Tensor) -> list[list[int]]:
    """reference.py's definition, one Python integer at a time (no int64 anywhere)."""
    words = [payload[i] | payload[i + 1] << 8 for i in range(0, len(payload), 2)]
    rows = num_chunks(len(payload))
    words += [0] * (rows * CHUNK_WORDS - len(words))
    k = key.tolist()
    return [
        [sum(w * k[lane][i] for i, w in enumerate(words[c * CHUNK_WORDS:][:CHUNK_WORDS])) % PRIME
         for lane in range(LANES)]
        for c in range(rows)
    ]  # fmt: skip


@pytest.mark.parametrize("num_bytes", [2, 2 * CHUNK_WORDS, 2 * CHUNK_WORDS + 6])
def test_the_reference_is_the_definition(num_bytes: int) -> None:
    gen = torch.Generator().manual_seed(num_bytes)
    payload = torch.randint(0, 256, (num_bytes,), dtype=torch.uint8, generator=gen)
    payload[:2] = 255  # the largest word
    key = _key(1)
    key[:, 0] = PRIME - 1  # the largest key word: the sums must not overflow
    assert kv_digest(payload, key, "torch").tolist() == _definition(bytes(payload), key)


def test_the_digest_is_keyed_and_sees_every_byte() -> None:
    payload = torch.randint(0, 256, (3 * 2 * CHUNK_WORDS,), dtype=torch.uint8)
    digest = kv_digest(payload, _key(1))
    assert digest.shape == (3, LANES) and digest.dtype == torch.int32
    assert not torch.equal(kv_digest(payload, _key(2)), digest)  # another transfer's key
    for position in (0, 1, 2 * CHUNK_WORDS, payload.numel() - 1):
        changed = payload.clone()
        changed[position] ^= 0x80
        assert not torch.equal(kv_digest(changed, _key(1)), digest), position


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="16-bit words"):
        kv_digest(torch.zeros(3, dtype=torch.uint8), _key(1))
    with pytest.raises(ValueError, match="key must be"):
        kv_digest(torch.zeros(4, dtype=torch.uint8), _key(1)[:, :8])
    with pytest.raises(ValueError, match="flat contiguous uint8"):
        kv_digest(torch.zeros(4, dtype=torch.int16), _key(1))


SCRIPT = r"""
import torch
from kernels.kv_digest import CHUNK_WORDS, LANES, PRIME, kv_digest

gen = torch.Generator().manual_seed(0)
key = torch.randint(0, PRIME, (LANES, CHUNK_WORDS), dtype=torch.int64, generator=gen)
key[:, -1] = PRIME - 1
for num_bytes in (2, 2 * CHUNK_WORDS, 5 * 2 * CHUNK_WORDS + 10):
    payload = torch.randint(0, 256, (num_bytes,), dtype=torch.uint8, generator=gen)
    payload[-2:] = 255
    fast, ref = kv_digest(payload, key, "triton"), kv_digest(payload, key, "torch")
    assert torch.equal(fast, ref), (num_bytes, fast, ref)
print("ok")
"""


def test_triton_digest_matches_the_reference() -> None:
    pytest.importorskip("triton")
    env = child_env(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
