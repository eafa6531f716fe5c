"""The raw ucxx ceiling of `pd-bench transfer`: the request's bytes, one buffer per layer,
sent with plain `ucxx` endpoint sends between the same two processes (no protocol, no
packing, no staging), every layer in flight at once; on CUDA from GPU memory to GPU memory.
Against it, transport and pack overheads show apart from the link.

    decode child:   raw_ucx_sink(conn, device, num_layers, layer_bytes, reps)
                    listens, tells the port over the Pipe, receives `reps` rounds, acks each
    prefill side:   await raw_ucx_gbps(port, device, num_layers, layer_bytes, reps) -> GB/s
"""

from __future__ import annotations

import asyncio
import time
from multiprocessing.connection import Connection

import torch

from cache_transfer.transports.ucx.runtime import RUNTIME, ucxx

TIMEOUT_S = 60.0


def _buffers(device: torch.device, num_layers: int, layer_bytes: int) -> list[torch.Tensor]:
    return [torch.ones(layer_bytes, dtype=torch.uint8, device=device) for _ in range(num_layers)]


def _ucx(buf: torch.Tensor):
    return buf.numpy() if buf.device.type == "cpu" else buf


async def raw_ucx_sink(
    conn: Connection, device: torch.device, num_layers: int, layer_bytes: int, reps: int
) -> None:
    """Receive `reps` rounds of `num_layers` buffers; ack each round with one byte."""
    holder = object()
    RUNTIME.acquire(holder)
    bufs = _buffers(device, num_layers, layer_bytes)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    done = asyncio.get_running_loop().create_future()

    async def serve(ep) -> None:
        try:
            ack = torch.ones(1, dtype=torch.uint8)
            for _ in range(reps):
                await asyncio.gather(*(ep.recv(_ucx(buf)) for buf in bufs))
                await ep.send(ack.numpy())
            if not done.done():
                done.set_result(None)
        except Exception as error:  # surfaced to the prefill side as a missing ack
            if not done.done():
                done.set_exception(error)

    listener = ucxx.create_listener(serve)
    try:
        conn.send(listener.port)
        await asyncio.wait_for(done, TIMEOUT_S)
    finally:
        listener.close()
        await RUNTIME.release(holder)


async def raw_ucx_gbps(
    port: int, device: torch.device, num_layers: int, layer_bytes: int, reps: int
) -> float:
    """Send `reps` rounds to the sink at 127.0.0.1:`port`; GB/s of the best round (sent until
    the sink acked having everything)."""
    holder = object()
    RUNTIME.acquire(holder)
    try:
        bufs = _buffers(device, num_layers, layer_bytes)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        ep = await ucxx.create_endpoint("127.0.0.1", port)
        ack = torch.empty(1, dtype=torch.uint8)
        best_s = float("inf")
        for _ in range(reps):
            start_s = time.perf_counter()
            await asyncio.wait_for(asyncio.gather(*(ep.send(_ucx(buf)) for buf in bufs)), TIMEOUT_S)
            await asyncio.wait_for(ep.recv(ack.numpy()), TIMEOUT_S)
            best_s = min(best_s, time.perf_counter() - start_s)
        await ep.close()
        return num_layers * layer_bytes / best_s / 1e9
    finally:
        await RUNTIME.release(holder)
