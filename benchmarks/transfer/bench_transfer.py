"""pd-bench transfer: one synthetic request's KV, prefill process -> decode process, real path.

    pd-bench transfer [--transport ucx|tcp|local] [--model llama3-8b] [--prompt-tokens 2048]
                      [--device cpu|cuda] [--iters 3] [--src-tp A --dst-tp B]

The prefill side (this process) packs the request's blocks per layer (`KVSender.send_layer`),
the transport moves them, the decode side (a child process; the same process for `local`)
validates and unpacks them into other, random block ids, then checks every byte. End to end
runs from the handshake's ack to the decode side having unpacked the last layer (device work
included). "sequential" awaits each layer's send before the next (per-layer latency);
"pipelined" puts every layer in flight at once, as when compute outpaces the wire; "batched"
hands every layer over in one call (`KVSender.send_layers`: one message, as a prefill node
sends all the layers packed by the time it looks), so per-message costs are paid once; the
first token goes right behind it, not after its send completed, as a prefill node sends it.
Written in place (`--in-place`), a layer is copied block to block into the receiver's blocks
(nothing packed) and only headers cross the transport.

Ceilings, measured in the same run: on CPU a plain TCP socket between the same two processes
and `ucx_perftest` over tcp (when its binary is present); on CUDA a torch copy of the same
bytes GPU0 -> GPU1 (the decode side runs on GPU1). Exit code 1 unless every request landed
byte-exact.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from benchmarks.transfer import ceilings as transfer_ceilings
from benchmarks.transfer.ceilings import PackRates
from benchmarks.transfer.decode import TIMEOUT_S
from benchmarks.transfer.peer import DecodePeer
from benchmarks.transfer.spec import TransferSpec, layout_for
from benchmarks.transfer.tp_ranks import rank_heads
from benchmarks.transfer.tp_transfer import report_tp, run_tp_requests
from cache_transfer import CudaIpcSharing, KVTransferManager, TransferState, make_transport

MODES = ("sequential", "pipelined", "batched")
RAW_UCX_ROW = "raw ucxx sends, same 2 processes"
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


async def run_requests(
    spec: TransferSpec, devices: tuple[torch.device, torch.device], iters: int
) -> tuple[dict[str, list[Run]], dict[str, float | None]]:
    """Per mode, `iters` requests after one warm-up; then the ceilings between the same two
    processes: on the host a plain socket, over ucx raw ucxx sends."""
    peer = DecodePeer(spec, devices[1])
    try:
        sharing = CudaIpcSharing() if spec.in_place else None
        manager = KVTransferManager(
            make_transport(spec.transport), spec.layout, sharing=sharing, kv_device=devices[0]
        )
        caches = spec.src_caches(devices[0])
        rng = random.Random(spec.seed)
        runs: dict[str, list[Run]] = {}
        for mode in MODES:
            runs[mode] = [await _one_request(spec, manager, peer, caches, mode, rng)]
            for _ in range(iters):
                runs[mode].append(await _one_request(spec, manager, peer, caches, mode, rng))
            del runs[mode][0]
        await manager.close()
        between: dict[str, float | None] = {"socket": None, "raw_ucx": None}
        if not peer.in_process and devices[0].type == "cpu":
            between["socket"] = await peer.socket_gbps(spec.request_bytes, spec.layer_bytes)
        if spec.transport == "ucx" and not peer.in_process:
            between["raw_ucx"] = await peer.raw_ucx_gbps(
                devices[0], spec.layout.num_layers, spec.layer_bytes
            )
        return runs, between
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
    src_block_ids = rng.sample(range(spec.num_pool_blocks), spec.num_blocks)  # set-up, untimed
    layers = [(i, k, v) for i, (k, v) in enumerate(caches)]
    start_s = time.perf_counter()
    sender = manager.create_sender(ticket, timeout_s=TIMEOUT_S)
    while sender.state < TransferState.WAITING and not sender.finished:
        await asyncio.sleep(0)
    acked_s = time.perf_counter()
    layer_s = []
    if mode == "batched":  # the first token right behind the layers, as a prefill node sends it
        sending = asyncio.ensure_future(sender.send_layers(layers, src_block_ids))
        await asyncio.sleep(0)  # the layers are in the sender's hands
        await sender.send_first_token(1)
        await sending
    elif mode == "pipelined":
        await asyncio.gather(*(sender.send_layer(*layer, src_block_ids) for layer in layers))
    else:
        for layer in layers:
            layer_start_s = time.perf_counter()
            await sender.send_layer(*layer, src_block_ids)
            layer_s.append(time.perf_counter() - layer_start_s)
    if mode != "batched":
        await sender.send_first_token(1)
    await sender.wait()
    result = await peer.result(src_block_ids)
    if sender.state != TransferState.SUCCESS or result.state != TransferState.SUCCESS:
        raise RuntimeError(f"transfer failed: sender {sender.error}; receiver {result.error}")
    transfer_s = result.finished_s - acked_s
    return Run(acked_s - start_s, transfer_s, result.num_bytes, layer_s, result.exact)


def measure_ceilings(
    spec: TransferSpec,
    devices: tuple[torch.device, torch.device],
    between: dict[str, float | None],
) -> list[tuple[str, float | None]]:
    """(label, GB/s) rows; the first with a figure is the ceiling."""
    src, dst = devices
    raw = [(RAW_UCX_ROW, between["raw_ucx"])] if spec.transport == "ucx" else []
    if src.type == "cuda":
        peer = transfer_ceilings.peer_copy_gbps(spec, src, dst)
        return [(f"torch peer copy {src} -> {dst}", peer), *raw]
    socket_row = ("plain TCP socket, 2 processes", between["socket"])
    if spec.transport == "local":
        return [("memcpy, in process", transfer_ceilings.peer_copy_gbps(spec, src, dst))]
    perftest = transfer_ceilings.ucx_perftest_gbps(
        spec.layer_bytes, max(64, (1 << 30) // spec.layer_bytes)
    )
    perftest_row = ("ucx_perftest tag_bw over tcp, 2 processes", perftest)
    if spec.transport == "ucx":
        return [perftest_row, *raw, socket_row]
    return [socket_row, perftest_row]


def print_report(
    spec: TransferSpec,
    device: str,
    runs: dict[str, list[Run]],
    ceilings: list[tuple[str, float | None]],
    pack_unpack: dict[str, tuple[PackRates, PackRates, float | None]],
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
    for impl, (pack, unpack, copy_gbps) in pack_unpack.items():
        for name, rate in ((f"pack_layer (gather, {impl})", pack), (f"unpack_layer (scatter, {impl})", unpack)):  # fmt: skip
            print(f"{f'{name}, per call':<52}{rate.per_call:>8.2f}")
            if rate.on_gpu is not None and copy_gbps:
                share = f"{100 * rate.on_gpu / copy_gbps:>10.0f}% of a device copy of the same bytes ({copy_gbps:.0f} GB/s)"  # fmt: skip
                print(f"{f'{name}, on the GPU (graph replay)':<52}{rate.on_gpu:>8.2f}{share}")
    raw = dict(ceilings).get(RAW_UCX_ROW)
    if raw:
        for mode, mode_runs in runs.items():
            raw_share = max(r.gbps for r in mode_runs) / raw
            print(f"{spec.transport} {mode} / raw ucxx: {100 * raw_share:.0f}%")
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
    parser.add_argument(
        "--transport",
        default="ucx",
        choices=["ucx", "tcp", "local"],
        help="KV transport between the two processes (local: one process)",
    )
    parser.add_argument(
        "--model",
        default="llama3-8b",
        help="KV shape of a named model, e.g. llama3-8b, qwen3-8b:layers=4",
    )
    parser.add_argument(
        "--prompt-tokens",
        type=int,
        default=2048,
        help="tokens of the one synthetic request whose KV moves",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="where both caches live (cuda: GPU0 -> GPU1, or GPU0 -> GPU0 on one)",
    )
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float16", "float32", "fp8_e4m3"],
        help="KV cache dtype (fp8_e4m3: --kv-cache-dtype fp8_e4m3's blocks, half of bf16's)",
    )
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument(
        "--iters", type=int, default=3, help="timed transfers per mode; the best is reported"
    )
    parser.add_argument(
        "--src-tp", type=int, default=1,
        help="tensor-parallel ranks of the prefill side (each its own process, sending its kv "
        "heads straight to the decode ranks holding them: tp_transfer.py)",
    )  # fmt: skip
    parser.add_argument(
        "--dst-tp", type=int, default=1, help="tensor-parallel ranks of the decode side"
    )
    parser.add_argument(
        "--in-place",
        action="store_true",
        help="cuda, both caches on one GPU: the sender writes each layer into the receiver's "
        "pool itself (CUDA IPC, what nodes on one GPU do) instead of sending it",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.prompt_tokens <= 0 or args.iters <= 0:
        parser.error("--prompt-tokens and --iters must be > 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    if args.in_place and (args.device != "cuda" or args.transport == "local"):
        parser.error("--in-place needs --device cuda and two processes (not --transport local)")
    try:
        spec = TransferSpec(
            layout_for(args.model, args.dtype, args.block_size),
            args.prompt_tokens,
            args.transport,
            in_place=args.in_place,
        )
    except ValueError as error:
        parser.error(str(error))
    # Pack/unpack run on the event loop thread: an intra-op pool would fight the other
    # process and the transport's I/O for the same cores.
    torch.set_num_threads(1)
    if args.src_tp > 1 or args.dst_tp > 1:
        return _main_tp(parser, args, spec)
    devices = _devices(args.device)
    runs, between = asyncio.run(
        asyncio.wait_for(run_requests(spec, devices, args.iters), TOTAL_TIMEOUT_S)
    )
    ceilings = measure_ceilings(spec, devices, between)
    impls = ("triton", "torch") if devices[0].type == "cuda" else ("torch",)
    pack_unpack = {
        impl: transfer_ceilings.pack_unpack_gbps(spec, devices[0], impl) for impl in impls
    }
    exact = print_report(spec, args.device, runs, ceilings, pack_unpack)
    return 0 if exact else 1


def _main_tp(parser: argparse.ArgumentParser, args: argparse.Namespace, spec: TransferSpec) -> int:
    """Between tensor-parallel sizes (tp_transfer.py)."""
    if min(args.src_tp, args.dst_tp) < 1 or args.in_place or args.transport == "local":
        parser.error("--src-tp/--dst-tp need sizes >= 1, two processes and no --in-place")
    try:
        rank_heads(spec, args.src_tp), rank_heads(spec, args.dst_tp)
    except ValueError as error:  # the model's heads do not divide
        parser.error(str(error))
    runs = asyncio.run(asyncio.wait_for(
        run_tp_requests(spec, args.src_tp, args.dst_tp, args.device, args.iters), TOTAL_TIMEOUT_S
    ))  # fmt: skip
    return 0 if report_tp(spec, args.src_tp, args.dst_tp, args.device, runs) else 1


def _devices(device: str) -> tuple[torch.device, torch.device]:
    """(prefill, decode): GPU0 and GPU1 on CUDA (one GPU: both on it), else the host."""
    if device == "cpu":
        return torch.device("cpu"), torch.device("cpu")
    decode_index = 1 if torch.cuda.device_count() > 1 else 0
    torch.cuda.set_device(0)
    return torch.device("cuda:0"), torch.device(f"cuda:{decode_index}")


if __name__ == "__main__":
    sys.exit(main())
