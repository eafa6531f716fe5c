"""KV transfer microbenchmark (CPU): one synthetic request's KV, prefill process -> decode process.

    python -m benchmarks.bench_transfer [--tokens 2048] [--layers 32] [--transport tcp] [--iters 3]

The real path end to end: pack_layer on the sender, the transport, validation and unpack_layer
into other block ids on the receiver, then the result back; layers are sent one after another
as a prefill would produce them. Reported beside the ceiling measured in the same run: a plain
TCP socket between two processes moving the same bytes (sendall -> recv_into a preallocated
buffer), plus in-process pack/unpack rates. Shape: llama3-8b (8 kv heads, head_dim 128, bf16).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import random
import socket
import statistics
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from cache_transfer import KVLayout, KVTransferManager, TransferState, make_transport
from cache_transfer.packing import alloc_staging, pack_layer, unpack_layer
from pdserve.v1 import node_pb2

TIMEOUT_S = 120.0
MODES = ("sequential", "pipelined")


@dataclass(frozen=True)
class Run:
    handshake_s: float  # create_sender -> ack
    transfer_s: float  # ack -> the receiver's result (every layer and the first token landed)
    num_bytes: int
    layer_s: list[float]  # per send_layer call (sequential mode)

    @property
    def gbps(self) -> float:
        return self.num_bytes / self.transfer_s / 1e9


def make_layout(num_layers: int) -> KVLayout:
    return KVLayout(
        model="synthetic:llama3-8b",
        num_layers=num_layers,
        num_kv_heads=8,
        head_dim=128,
        block_size=16,
        dtype="bfloat16",
    )


def make_caches(layout: KVLayout, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (num_blocks, *layout.block_shape)
    return [
        (torch.randn(shape, dtype=layout.torch_dtype), torch.randn(shape, dtype=layout.torch_dtype))
        for _ in range(layout.num_layers)
    ]


def decode_process(conn: Connection, transport: str, num_layers: int, num_tokens: int) -> None:
    """Child: reserve blocks, hand out a ticket, await the KV; once per request from the parent."""
    torch.set_num_threads(1)
    asyncio.run(_decode_loop(conn, transport, make_layout(num_layers), num_tokens))


async def _decode_loop(conn: Connection, transport: str, layout: KVLayout, num_tokens: int) -> None:
    num_blocks = layout.num_blocks_for(num_tokens)
    caches = [
        (torch.zeros_like(k), torch.zeros_like(v)) for k, v in make_caches(layout, 2 * num_blocks)
    ]
    manager = KVTransferManager(make_transport(transport), layout, caches)
    loop = asyncio.get_running_loop()
    while await loop.run_in_executor(None, conn.recv) == "ticket":
        dst_block_ids = random.sample(range(2 * num_blocks), num_blocks)
        receiver = manager.create_receiver(dst_block_ids, num_tokens, timeout_s=TIMEOUT_S)
        conn.send(receiver.ticket().SerializeToString())
        state = await receiver.wait()
        conn.send((int(state), receiver.num_bytes_received))
    await manager.close()


async def _prefill_side(conn: Connection, args: argparse.Namespace) -> dict[str, list[Run]]:
    """Per mode, `args.iters` requests after one warm-up (connections, staging buffers)."""
    layout = make_layout(args.layers)
    num_blocks = layout.num_blocks_for(args.tokens)
    caches = make_caches(layout, 2 * num_blocks)
    manager = KVTransferManager(make_transport(args.transport), layout)
    runs: dict[str, list[Run]] = {mode: [] for mode in MODES}
    for mode in MODES:
        for _ in range(args.iters + 1):
            runs[mode].append(await _one_request(conn, manager, caches, num_blocks, mode))
        del runs[mode][0]
    conn.send("stop")
    await manager.close()
    return runs


async def _one_request(
    conn: Connection,
    manager: KVTransferManager,
    caches: list[tuple[torch.Tensor, torch.Tensor]],
    num_blocks: int,
    mode: str,
) -> Run:
    loop = asyncio.get_running_loop()
    conn.send("ticket")
    ticket = node_pb2.TransferTicket.FromString(await loop.run_in_executor(None, conn.recv))
    start_s = time.perf_counter()
    sender = manager.create_sender(ticket, timeout_s=TIMEOUT_S)
    while sender.state < TransferState.WAITING and not sender.finished:
        await asyncio.sleep(0)
    acked_s = time.perf_counter()
    src_block_ids = random.sample(range(2 * num_blocks), num_blocks)
    sends = [sender.send_layer(i, k, v, src_block_ids) for i, (k, v) in enumerate(caches)]
    layer_s = []
    if mode == "pipelined":  # every layer in flight at once, as when compute outpaces the wire
        await asyncio.gather(*sends)
    else:  # one layer at a time: the latency of one layer's send
        for send in sends:
            layer_start_s = time.perf_counter()
            await send
            layer_s.append(time.perf_counter() - layer_start_s)
    await sender.send_first_token(1)
    state = await sender.wait()
    end_s = time.perf_counter()
    recv_state, num_bytes = await loop.run_in_executor(None, conn.recv)
    if state != TransferState.SUCCESS or recv_state != TransferState.SUCCESS:
        raise RuntimeError(f"transfer failed: {sender.error}")
    return Run(acked_s - start_s, end_s - acked_s, num_bytes, layer_s)


def socket_ceiling(num_bytes: int, chunk_bytes: int) -> float:
    """GB/s of a plain loopback TCP socket into another process (best of 3)."""
    ctx = mp.get_context("spawn")
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    child = ctx.Process(target=_socket_sink, args=(port, num_bytes, 3), daemon=True)
    child.start()
    payload = memoryview(torch.randint(0, 256, (num_bytes,), dtype=torch.uint8).numpy())
    best_s = float("inf")
    conn, _ = server.accept()
    with conn:
        for _ in range(3):
            start_s = time.perf_counter()
            for offset in range(0, num_bytes, chunk_bytes):
                conn.sendall(payload[offset : offset + chunk_bytes])
            conn.recv(1)  # the sink's "got everything"
            best_s = min(best_s, time.perf_counter() - start_s)
    child.join(TIMEOUT_S)
    server.close()
    return num_bytes / best_s / 1e9


def _socket_sink(port: int, num_bytes: int, reps: int) -> None:
    buf = memoryview(bytearray(num_bytes))
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S) as conn:
        for _ in range(reps):
            got = 0
            while got < num_bytes:
                got += conn.recv_into(buf[got:], num_bytes - got)
            conn.sendall(b"k")


def pack_unpack_rates(layout: KVLayout, num_tokens: int) -> tuple[float, float]:
    """In-process GB/s of pack_layer and unpack_layer on one layer (warm buffers)."""
    num_blocks = layout.num_blocks_for(num_tokens)
    (k_cache, v_cache), *_ = make_caches(make_layout(1), 2 * num_blocks)
    ids = random.sample(range(2 * num_blocks), num_blocks)
    staging = alloc_staging(layout.layer_bytes(num_blocks))
    rates = []
    for op in (
        lambda: pack_layer(k_cache, v_cache, ids, staging),
        lambda: unpack_layer(staging, k_cache, v_cache, ids),
    ):
        op()
        start_s = time.perf_counter()
        for _ in range(5):
            op()
        rates.append(5 * staging.numel() / (time.perf_counter() - start_s) / 1e9)
    return rates[0], rates[1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048, help="prompt tokens of the request")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--transport", default="tcp", choices=["tcp"])
    parser.add_argument("--iters", type=int, default=3)
    args = parser.parse_args(argv)
    # Each process packs/unpacks on its event loop thread: a multi-threaded intra-op pool
    # would fight the other process and the zmq I/O threads for the same cores.
    torch.set_num_threads(1)
    layout = make_layout(args.layers)
    num_blocks = layout.num_blocks_for(args.tokens)
    layer_bytes = layout.layer_bytes(num_blocks)
    total_bytes = layer_bytes * args.layers

    ctx = mp.get_context("spawn")
    parent_conn, child_conn = ctx.Pipe()
    child = ctx.Process(
        target=decode_process,
        args=(child_conn, args.transport, args.layers, args.tokens),
        daemon=True,
    )
    child.start()
    runs = asyncio.run(asyncio.wait_for(_prefill_side(parent_conn, args), TIMEOUT_S))
    child.join(TIMEOUT_S)
    ceiling_gbps = socket_ceiling(total_bytes, layer_bytes)
    pack_gbps, unpack_gbps = pack_unpack_rates(layout, args.tokens)

    print(
        f"{layout.model}: {args.layers} layers x {layout.num_kv_heads} kv heads x "
        f"{layout.head_dim} ({layout.dtype}, block {layout.block_size}), {args.tokens} tokens: "
        f"{layer_bytes / 2**20:.1f} MiB/layer, {total_bytes / 2**20:.1f} MiB/request; "
        f"best of {args.iters}"
    )
    print(f"{'path':<46}{'GB/s':>7}{'% ceiling':>11}{'layer p50 ms':>14}{'max ms':>8}")
    print(f"{'plain TCP socket, 2 processes (ceiling)':<46}{ceiling_gbps:>7.2f}{100:>10.0f}%")
    for mode, mode_runs in runs.items():
        best = max(mode_runs, key=lambda r: r.gbps)
        latency = ""
        if best.layer_s:
            latency = (
                f"{statistics.median(best.layer_s) * 1e3:>14.2f}{max(best.layer_s) * 1e3:>8.2f}"
            )
        name = f"{args.transport}: pack+send+unpack, {mode}"
        print(f"{name:<46}{best.gbps:>7.2f}{100 * best.gbps / ceiling_gbps:>10.0f}%{latency}")
    print(f"{'pack_layer (gather, in process)':<46}{pack_gbps:>7.2f}")
    print(f"{'unpack_layer (scatter, in process)':<46}{unpack_gbps:>7.2f}")
    handshake_s = min(r.handshake_s for mode_runs in runs.values() for r in mode_runs)
    print(f"handshake round trip: {handshake_s * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
