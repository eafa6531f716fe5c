"""What a message's tag covers of its payload: the bytes of a host payload, or the keyed
digest of a CUDA payload computed on its GPU (`kernels.kv_digest`), never its bytes copied to
the host.

```
host payload   tag over the payload's bytes (Poly1305 on the host: ~8-16 GB/s on this CPU)
CUDA payload   digest = kv_digest(payload, key) on the current stream ─► pinned host copy ─►
               one CUDA event per batch, awaited off the loop (cuda_waits) ─► tag over the
               digest (16 bytes per 16 KiB of payload)
```

Why a digest is enough (the construction, its security in one paragraph): the digest is a
multilinear hash over Z_p (p = 2^31 - 1) of each 16 KiB chunk's 16-bit words, in 4 lanes with
independent key words; its key is derived per transfer from the frame key and never leaves the
two nodes. Each message's Poly1305 tag over (header, digest) uses a one-time key, so it is
uniformly random whatever the digest: a forger learns nothing of the digest key from the tags
it sees. Forging a payload of the same header then needs a different payload with the same
digest: in the chunk where the two differ, some word difference d (0 < |d| < 2^16) is a unit
mod p, so each lane collides for exactly one value of one key word, probability <= 2 / 2^31,
and the 4 lanes together <= 2^-120 per attempt (a failed attempt fails the transfer). Forging
anything else (another header or digest) is forging Poly1305 under a one-time key (<= 2^-100
for these lengths) or the HMAC-SHA256 PRF that derives the keys: the usual Wegman-Carter
argument.
"""

from __future__ import annotations

import torch

from cache_transfer.frame_auth.frame_key import Chunk, FrameKey
from cache_transfer.transports.cuda_waits import new_event, wait_event
from kernels.kv_digest import kv_digest

DIGEST_WAIT_TIMEOUT_S = 120.0  # as the transports' wait for queued CUDA work


def host_part(payload: torch.Tensor) -> list[Chunk]:
    """A host payload's bytes, as the tag reads them (no copy)."""
    return [payload.numpy().data.cast("B")]


async def device_parts(key: FrameKey, payloads: list[torch.Tensor]) -> list[list[Chunk]]:
    """The digests of CUDA `payloads` (behind the work queued on the current stream), on the
    host: one launch each, one copy each into pinned memory, one event for all."""
    host: list[torch.Tensor] = []
    for payload in payloads:
        with torch.cuda.device(payload.device):
            digest = kv_digest(payload, key.digest_key(payload.device))  # [chunks, LANES] int32
            pinned = torch.empty(digest.shape, dtype=digest.dtype, pin_memory=True)
            pinned.copy_(digest, non_blocking=True)
        host.append(pinned)
    for device in {payload.device for payload in payloads}:  # one event per device, after all
        event = new_event()
        event.record(torch.cuda.current_stream(device))
        await wait_event(event, DIGEST_WAIT_TIMEOUT_S)
    return [[digest.numpy().data.cast("B")] for digest in host]


def digest_part(key: FrameKey, payload: torch.Tensor) -> list[Chunk]:
    """The digest of a payload where it lives, computed now (a host payload: the reference on
    the CPU; used when a CUDA sender's digest must be checked against a host buffer)."""
    digest = kv_digest(payload, key.digest_key(payload.device)).cpu()
    return [digest.numpy().data.cast("B")]
