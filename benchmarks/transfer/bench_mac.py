"""pd-bench mac: what the KV hand-off's frame MACs cost (issue 39), beside the copy rate.

    pd-bench mac [--model llama3-8b] [--prompt-tokens 2048 8192] [--device cpu|cuda] [--iters 5]

For one layer of one request (K and V of `--prompt-tokens` tokens, bf16: 4 KiB a token for
llama3-8b), best of `--iters`:

- host (a tcp hand-off's payloads, host memory): the MAC the nodes use (Poly1305 under a
  one-time key, `FrameKey.tag`), keyed BLAKE2b and HMAC-SHA256 (hashlib) for comparison, and
  `--kv-encrypt`'s AES-256-CTR into a staging buffer (`FrameCipher.payload`: what each end adds
  when frames are encrypted, beside the MAC), against a host memcpy of the same bytes (the
  ceiling: each reads the bytes once);
- device (`--device cuda`: a ucx hand-off's GPU payloads): the keyed digest (kernels/kv_digest,
  Triton and the torch reference) against a device copy of the same bytes, and what a sender
  pays per message on top (digest, its copy to the host, the event awaited, the tag:
  `FrameSealer.parts`), per layer and for all layers of the request in one message.

Then: the MAC's share of a layer's time on the wire at the transport rates measured by
`pd-bench transfer` (its results files), and what a TTFT would have to be for the sender's
per-request MAC time to stay under 1 % of it (`pd-bench ttft` measures the real one).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
import sys
import time
from collections.abc import Callable

import numpy as np
import torch

from cache_transfer.frame_auth.frame_cipher import FrameCipher
from cache_transfer.frame_auth.frame_key import TO_RECEIVER, FrameKey
from cache_transfer.frame_auth.frame_sealer import FrameSealer
from cache_transfer.protocol import MessageBody
from kernels.kv_digest import kv_digest
from pdserve.security import ClusterAuth
from pdserve.v1 import transfer_pb2

BYTES_PER_TOKEN_LAYER = {"llama3-8b": 2 * 8 * 128 * 2, "qwen2.5-7b": 2 * 4 * 128 * 2}
NUM_LAYERS = {"llama3-8b": 32, "qwen2.5-7b": 28}
AUTH = ClusterAuth(b"pd-bench-mac-secret-0123456789")


def best_s(fn: Callable[[], object], iters: int, sync: Callable[[], None] = lambda: None) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def row(name: str, num_bytes: int, seconds: float, ceiling_s: float | None = None) -> str:
    share = f"{ceiling_s / seconds * 100:8.0f}%" if ceiling_s else " " * 9
    return f"{name:58s} {num_bytes / seconds / 1e9:8.2f} {share} {seconds * 1e3:9.3f}"


def host_rows(num_bytes: int, iters: int) -> tuple[list[str], float]:
    """The host MACs of one layer; returns the rows and the nodes' MAC time (s)."""
    buf = np.random.default_rng(0).integers(0, 255, num_bytes, dtype=np.uint8)
    view, dst, key = buf.data, np.empty_like(buf), FrameKey(AUTH, "t", bytes(16), "c")
    cipher, manifest = FrameCipher(key), transfer_pb2.LayerManifest(layer_idx=1, token_end=9)
    src, out = torch.from_numpy(buf), torch.from_numpy(dst)
    copy_s = best_s(lambda: np.copyto(dst, buf), iters)
    tag_s = best_s(lambda: key.tag(TO_RECEIVER, 1, b"header", [view]), iters)
    rows = [
        row("host memcpy of the same bytes (ceiling)", num_bytes, copy_s),
        row("Poly1305, one-time key per frame (the nodes' host MAC)", num_bytes, tag_s, copy_s),
        row("keyed BLAKE2b-128 (hashlib)", num_bytes, best_s(
            lambda: hashlib.blake2b(view, key=bytes(32), digest_size=16).digest(), iters), copy_s),
        row("HMAC-SHA256 (hashlib)", num_bytes,
            best_s(lambda: hmac.digest(bytes(32), view, "sha256"), iters), copy_s),
        row("AES-256-CTR into staging (--kv-encrypt, each end)", num_bytes,
            best_s(lambda: cipher.payload(TO_RECEIVER, manifest, src, out), iters), copy_s),
    ]  # fmt: skip
    return rows, tag_s


def device_rows(num_bytes: int, num_layers: int, iters: int) -> tuple[list[str], float]:
    """The device digest of one layer, and a sender's whole cost per message; returns the
    rows and the per-request sender time (s) with every layer in one message."""
    device = torch.device("cuda")
    payload = torch.randint(0, 255, (num_bytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(payload)
    key = FrameKey(AUTH, "t", bytes(16), "c")
    digest_key = key.digest_key(device)
    sync = torch.cuda.synchronize
    copy_s = best_s(lambda: dst.copy_(payload), iters, sync)
    rows = [row("device copy of the same bytes (ceiling)", num_bytes, copy_s)]
    for impl in ("triton", "torch"):

        def digest(impl: str = impl) -> torch.Tensor:
            return kv_digest(payload, digest_key, impl)

        seconds = best_s(digest, iters, sync)
        rows.append(row(f"kv_digest {impl} (device)", num_bytes, seconds, copy_s))
    sealer = FrameSealer(TO_RECEIVER)
    sealer.bind(key)

    async def seal(count: int) -> None:
        messages: list[tuple[torch.Tensor | None, dict[str, MessageBody]]] = [
            (payload, {"layer_manifest": transfer_pb2.LayerManifest()}) for _ in range(count)
        ]
        parts = await sealer.parts(messages)
        for i, part in enumerate(parts):
            key.tag(TO_RECEIVER, i, b"header", part)

    one_s = best_s(lambda: asyncio.run(seal(1)), iters)
    all_s = best_s(lambda: asyncio.run(seal(num_layers)), iters)
    rows.append(row("a sender's MAC, 1 layer a message (digest, D2H, event, tag)",
                    num_bytes, one_s, copy_s))  # fmt: skip
    rows.append(row(f"the same, {num_layers} layers in one message", num_bytes * num_layers,
                    all_s, copy_s * num_layers))  # fmt: skip
    return rows, all_s


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pd-bench mac", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama3-8b", choices=sorted(BYTES_PER_TOKEN_LAYER))
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    head = f"{'path':58s} {'GB/s':>8} {'% ceil':>9} {'ms/layer':>9}"
    for tokens in args.prompt_tokens:
        num_bytes = tokens * BYTES_PER_TOKEN_LAYER[args.model]
        num_layers = NUM_LAYERS[args.model]
        print(f"\n{args.model}, {tokens} tokens: one layer = {num_bytes / 2**20:.1f} MiB, "
              f"{num_layers} layers")  # fmt: skip
        print(head + "\n" + "-" * len(head))
        rows, tag_s = host_rows(num_bytes, args.iters)
        print("\n".join(rows))
        print(f"host MAC per request (both ends, {num_layers} layers): "
              f"{2 * tag_s * num_layers * 1e3:.2f} ms")  # fmt: skip
        if args.device == "cuda":
            rows, request_s = device_rows(num_bytes, num_layers, args.iters)
            print("\n".join(rows))
            print(f"device MAC per request, sender (one message): {request_s * 1e3:.2f} ms; "
                  f"<= 1 % of TTFT when TTFT >= {request_s * 1e5:.0f} ms")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
