"""A prefill-side peer in its own process, for tests that SIGKILL it mid-transfer.

    python peer_process.py layers BACKEND     stdin: a TransferTicket (hex); sends every layer of
                                              KILL_LAYOUT, one each LAYER_GAP_S, then hangs
                                              (never the first token)
    python peer_process.py payload BACKEND    stdin: "ADDRESS NUM_BYTES"; sends one raw payload
                                              (header b"big"), then hangs

Prints "ready" once its transport is up, then "sent N" after each layer's send returns.
"""

from __future__ import annotations

import asyncio
import sys

import torch
from transfer_helpers import make_kill_layout, random_caches

from cache_transfer import KVTransferManager, make_transport
from pdserve.v1 import node_pb2

LAYER_GAP_S = 0.05
KILL_LAYOUT = make_kill_layout()


async def send_layers(backend: str) -> None:
    manager = KVTransferManager(make_transport(backend), KILL_LAYOUT)
    print("ready", flush=True)
    ticket = node_pb2.TransferTicket.FromString(bytes.fromhex(await _read_line()))
    num_blocks = KILL_LAYOUT.num_blocks_for(ticket.num_tokens)
    caches = random_caches(KILL_LAYOUT, num_blocks)
    sender = manager.create_sender(ticket, timeout_s=60)
    for layer_idx, (k_cache, v_cache) in enumerate(caches):
        await sender.send_layer(layer_idx, k_cache, v_cache, list(range(num_blocks)))
        print(f"sent {layer_idx}", flush=True)
        await asyncio.sleep(LAYER_GAP_S)
    await asyncio.sleep(3600)


async def send_payload(backend: str) -> None:
    transport = make_transport(backend)
    transport.start(_Ignore())
    print("ready", flush=True)
    address, num_bytes = (await _read_line()).split()
    payload = torch.zeros(int(num_bytes), dtype=torch.uint8)
    await transport.send(address, b"big", payload)
    await asyncio.sleep(3600)


class _Ignore:
    def prepare(self, peer_id: str, header: bytes, payload_bytes: int) -> None:
        return None

    def complete(self, peer_id: str, header: bytes, payload: torch.Tensor | None) -> None:
        pass

    def abandon(self, peer_id: str, header: bytes, payload: torch.Tensor) -> None:
        pass


async def _read_line() -> str:
    return (await asyncio.to_thread(sys.stdin.readline)).strip()


if __name__ == "__main__":
    torch.set_num_threads(1)
    mode, backend = sys.argv[1:3]
    asyncio.run(send_layers(backend) if mode == "layers" else send_payload(backend))
