"""pd-bench transfer: one synthetic request's KV, prefill process -> decode process, real path.

    pd-bench transfer [--transport ucx|tcp|local] [--model llama3-8b] [--prompt-tokens 2048]
                      [--device cpu|cuda] [--iters 3]

The prefill side (this process) packs the request's blocks per layer (`KVSender.send_layer`),
the transport moves them, the decode side (a child process; the same process for `local`)
validates and unpacks them into other, random block ids, then checks every byte. End to end
runs from the handshake's ack to the decode side having unpacked the last layer (device work
included). "sequential" awaits each layer's send before the next (per-layer latency);
"pipelined" puts every layer in flight at once, as when compute outpaces the wire.

Ceilings, measured in the same run: on CPU a plain TCP socket between the same two processes
and `ucx_perftest` over tcp (when its binary is present); on CUDA a torch copy of the same
bytes GPU0 -> GPU1 (the decode side runs on GPU1). Exit code 1 unless every request landed
byte-exact.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import random
import socket
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from benchmarks import transfer_ceilings
from benchmarks.transfer_decode import TIMEOUT_S, DecodeSide, RequestResult, decode_process
from benchmarks.transfer_spec import TransferSpec, layout_for
from cache_transfer import KVTransferManager, TransferState, make_transport
from pdserve.v1 import node_pb2

MODES = ("sequential", "pipelined")
TOTAL_TIMEOUT_S = 240.0


@dataclass(frozen=True)
class Run:
    handshake_s: float  # create_sender -> ack
    transfer_s: float  # ack -> the decode side unpacked the last layer
    num_bytes: int
    layer_s: list[float]  # per send_layer call (sequential mode)
    exact: bool

    @property
    def gbps(self) -> float:
        return self.num_bytes / self.transfer_s / 1e9


class DecodePeer:
    """The decode side, in a child process (driven over a Pipe) or in this one (`local`)."""

    def __init__(self, spec: TransferSpec, device: torch.device) -> None:
        self._side: DecodeSide | None = None
        self._process: mp.process.BaseProcess | None = None
        if spec.transport == "local":
            self._side = DecodeSide(spec, device)
            return
        ctx = mp.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        child_device = "cpu" if device.type == "cpu" else "cuda:0"
        self._process = ctx.Process(
            target=decode_process, args=(child_conn, spec, child_device), daemon=True
        )
        with _visible_devices_first(device):
            self._process.start()

    @property
    def in_process(self) -> bool:
        return self._side is not None

    async def ticket(self) -> node_pb2.TransferTicket:
        raw = self._side.open() if self._side else await self._ask("ticket")
        return node_pb2.TransferTicket.FromString(raw)

    async def result(self, src_block_ids: list[int]) -> RequestResult:
        if self._side is not None:
            return await self._side.result(src_block_ids)
        return await self._ask("result", src_block_ids)

    async def socket_gbps(self, num_bytes: int, chunk_bytes: int, reps: int = 3) -> float:
        """A plain loopback TCP socket into the decode process: GB/s, best of `reps`."""
        server = socket.create_server(("127.0.0.1", 0))
        payload = memoryview(os.urandom(num_bytes))
        self._conn.send(("socket", server.getsockname()[1], num_bytes, reps))
        server.settimeout(TIMEOUT_S)
        conn, _ = await asyncio.to_thread(server.accept)
        best_s = float("inf")
        with conn, server:
            for _ in range(reps):
                start_s = time.perf_counter()
                for offset in range(0, num_bytes, chunk_bytes):
                    conn.sendall(payload[offset : offset + chunk_bytes])
                conn.recv(1)  # the sink has everything
                best_s = min(best_s, time.perf_counter() - start_s)
        assert await self._recv() == "ok"
        return num_bytes / best_s / 1e9

    async def close(self) -> None:
        if self._side is not None:
            await self._side.close()
        elif self._process is not None:
            if self._process.is_alive():
                self._conn.send(("stop",))
            await asyncio.to_thread(self._process.join, TIMEOUT_S)
            if self._process.is_alive():
                self._process.kill()

    async def _ask(self, *command: object) -> object:
        self._conn.send(command)
        return await self._recv()

    async def _recv(self) -> object:
        def recv() -> object:
            assert self._process is not None
            deadline_s = time.monotonic() + TIMEOUT_S
            while not self._conn.poll(0.5):
                if not self._process.is_alive():
                    raise RuntimeError(f"the decode process died (exit {self._process.exitcode})")
                if time.monotonic() > deadline_s:
                    raise TimeoutError(f"the decode process answered nothing for {TIMEOUT_S}s")
            return self._conn.recv()

        return await asyncio.to_thread(recv)


class _visible_devices_first:
    """Spawn the decode process with `device` as its cuda:0 (what ucxx's progress thread and
    UCX's cuda_ipc assume), every GPU still visible so cuda_ipc can reach the peer."""

    def __init__(self, device: torch.device) -> None:
        self._saved: str | None = None
        self._order: str | None = None
        if device.type == "cuda":
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            ids = (
                visible.split(",")
                if visible
                else [str(i) for i in range(torch.cuda.device_count())]
            )
            index = device.index or 0
            self._order = ",".join([ids[index], *ids[:index], *ids[index + 1 :]])
            self._saved = visible

    def __enter__(self) -> None:
        if self._order is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = self._order

    def __exit__(self, *exc: object) -> None:
        if self._order is None:
            return
        if self._saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = self._saved


async def run_requests(
    spec: TransferSpec, devices: tuple[torch.device, torch.device], iters: int
) -> tuple[dict[str, list[Run]], float | None]:
    """Per mode, `iters` requests after one warm-up; then the socket ceiling (child only)."""
    peer = DecodePeer(spec, devices[1])
    try:
        manager = KVTransferManager(make_transport(spec.transport), spec.layout)
        caches = spec.src_caches(devices[0])
        rng = random.Random(spec.seed)
        runs: dict[str, list[Run]] = {}
        for mode in MODES:
            runs[mode] = [await _one_request(spec, manager, peer, caches, mode, rng)]
            for _ in range(iters):
                runs[mode].append(await _one_request(spec, manager, peer, caches, mode, rng))
            del runs[mode][0]
        await manager.close()
        socket_gbps = None
        if not peer.in_process:
            socket_gbps = await peer.socket_gbps(spec.request_bytes, spec.layer_bytes)
        return runs, socket_gbps
    finally:
        await peer.close()


async def _one_request(
    spec: TransferSpec,
    manager: KVTransferManager,
    peer: DecodePeer,
    caches: list[tuple[torch.Tensor, torch.Tensor]],
    mode: str,
    rng: random.Random,
) -> Run:
    ticket = await peer.ticket()
    start_s = time.perf_counter()
    sender = manager.create_sender(ticket, timeout_s=TIMEOUT_S)
    while sender.state < TransferState.WAITING and not sender.finished:
        await asyncio.sleep(0)
    acked_s = time.perf_counter()
    src_block_ids = rng.sample(range(spec.num_pool_blocks), spec.num_blocks)
    sends = [sender.send_layer(i, k, v, src_block_ids) for i, (k, v) in enumerate(caches)]
    layer_s = []
    if mode == "pipelined":
        await asyncio.gather(*sends)
    else:
        for send in sends:
            layer_start_s = time.perf_counter()
            await send
            layer_s.append(time.perf_counter() - layer_start_s)
    await sender.send_first_token(1)
    await sender.wait()
    result = await peer.result(src_block_ids)
    if sender.state != TransferState.SUCCESS or result.state != TransferState.SUCCESS:
        raise RuntimeError(f"transfer failed: sender {sender.error}; receiver {result.error}")
    transfer_s = result.finished_s - acked_s
    return Run(acked_s - start_s, transfer_s, result.num_bytes, layer_s, result.exact)


def measure_ceilings(
    spec: TransferSpec, devices: tuple[torch.device, torch.device], socket_gbps: float | None
) -> list[tuple[str, float | None]]:
    """(label, GB/s) rows; the first with a figure is the ceiling."""
    src, dst = devices
    if src.type == "cuda":
        return [
            (f"torch peer copy {src} -> {dst}", transfer_ceilings.peer_copy_gbps(spec, src, dst))
        ]
    socket_row = ("plain TCP socket, 2 processes", socket_gbps)
    if spec.transport == "local":
        return [("memcpy, in process", transfer_ceilings.peer_copy_gbps(spec, src, dst))]
    perftest = transfer_ceilings.ucx_perftest_gbps(
        spec.layer_bytes, max(64, (1 << 30) // spec.layer_bytes)
    )
    perftest_row = ("ucx_perftest tag_bw over tcp, 2 processes", perftest)
    return [perftest_row, socket_row] if spec.transport == "ucx" else [socket_row, perftest_row]


def print_report(
    spec: TransferSpec,
    device: str,
    runs: dict[str, list[Run]],
    ceilings: list[tuple[str, float | None]],
    pack_unpack: tuple[float, float],
) -> bool:
    """Print the table; True when every request landed byte-exact."""
    iters = len(runs[MODES[0]])
    print(f"{spec.describe()}; {spec.transport} on {device}, best of {iters}")
    print(f"{'path':<52}{'GB/s':>8}{'% ceiling':>11}{'layer p50 ms':>14}{'max ms':>9}")
    ceiling = next((gbps for _, gbps in ceilings if gbps is not None), None)

    def row(name: str, gbps: float | None, suffix: str = "") -> None:
        figure = f"{gbps:>8.2f}" if gbps is not None else f"{'n/a':>8}"
        share = f"{100 * gbps / ceiling:>10.0f}%" if gbps is not None and ceiling else " " * 11
        print(f"{name:<52}{figure}{share}{suffix}")

    for index, (name, gbps) in enumerate(ceilings):
        row(f"{name}{' (ceiling)' if index == 0 else ''}", gbps)
    for mode, mode_runs in runs.items():
        best = max(mode_runs, key=lambda r: r.gbps)
        latency = ""
        if best.layer_s:
            p50_ms, max_ms = statistics.median(best.layer_s) * 1e3, max(best.layer_s) * 1e3
            latency = f"{p50_ms:>14.2f}{max_ms:>9.2f}"
        row(f"{spec.transport}: pack+send+unpack, {mode}", best.gbps, latency)
    print(f"{'pack_layer (gather, in process)':<52}{pack_unpack[0]:>8.2f}")
    print(f"{'unpack_layer (scatter, in process)':<52}{pack_unpack[1]:>8.2f}")
    all_runs = [r for mode_runs in runs.values() for r in mode_runs]
    print(f"handshake round trip: {min(r.handshake_s for r in all_runs) * 1e3:.2f} ms")
    exact = all(r.exact for r in all_runs)
    verdict = "OK" if exact else "FAILED"
    print(
        f"byte-exact: {verdict} ({len(all_runs)} requests x {spec.layout.num_layers} layers, "
        "into other block ids)"
    )
    return exact


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pd-bench transfer", description=__doc__.split("\n\n")[0])
    parser.add_argument("--transport", default="ucx", choices=["ucx", "tcp", "local"])
    parser.add_argument("--model", default="llama3-8b", help="shape: llama3-8b, qwen3-8b:layers=4")
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--iters", type=int, default=3)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.prompt_tokens <= 0 or args.iters <= 0:
        parser.error("--prompt-tokens and --iters must be > 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    try:
        spec = TransferSpec(
            layout_for(args.model, args.dtype, args.block_size), args.prompt_tokens, args.transport
        )
    except ValueError as error:
        parser.error(str(error))
    # Pack/unpack run on the event loop thread: an intra-op pool would fight the other
    # process and the transport's I/O for the same cores.
    torch.set_num_threads(1)
    devices = _devices(args.device)
    runs, socket_gbps = asyncio.run(
        asyncio.wait_for(run_requests(spec, devices, args.iters), TOTAL_TIMEOUT_S)
    )
    ceilings = measure_ceilings(spec, devices, socket_gbps)
    pack_unpack = transfer_ceilings.pack_unpack_gbps(spec, devices[0])
    exact = print_report(spec, args.device, runs, ceilings, pack_unpack)
    return 0 if exact else 1


def _devices(device: str) -> tuple[torch.device, torch.device]:
    """(prefill, decode): GPU0 and GPU1 on CUDA (one GPU: both on it), else the host."""
    if device == "cpu":
        return torch.device("cpu"), torch.device("cpu")
    decode_index = 1 if torch.cuda.device_count() > 1 else 0
    torch.cuda.set_device(0)
    return torch.device("cuda:0"), torch.device(f"cuda:{decode_index}")


if __name__ == "__main__":
    sys.exit(main())
