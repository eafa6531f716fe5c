"""What `pd-bench transfer` measures the real path against, in the same run.

    ucx_perftest_gbps   UCX's own tag bandwidth test (two processes, tcp), from the libucx
                        wheel (or PATH); None when absent
    peer_copy_gbps      a torch copy of the same bytes, layer by layer, between two devices
                        (GPU0 -> GPU1: the NVLink ceiling; host -> host: memcpy)
    pack_unpack_gbps    pack_layer and unpack_layer alone, in process (on CUDA: the Triton
                        kernel and torch's index_select / index_copy_), per call (host
                        included) and, on CUDA, on the GPU (graph replay) beside a plain
                        device copy of the same bytes timed the same way
    (raw ucxx sends between the two processes: transfer_raw_ucx.py)

The plain-socket ceiling needs the decode process: bench_transfer.py drives it.
"""

from __future__ import annotations

import importlib.util
import os
import random
import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.transfer.spec import TransferSpec, synchronize
from cache_transfer.packing.block_ids import check_block_ids
from cache_transfer.packing.packed_layer import pack_layer, unpack_layer

PERFTEST_TIMEOUT_S = 60.0
_UCX_MBYTE = 1 << 20  # ucx_perftest's "MB"


def find_ucx_perftest() -> tuple[Path, Path | None] | None:
    """(ucx_perftest, the libucx library folder it needs) from the libucx wheel, else PATH."""
    spec = importlib.util.find_spec("libucx")
    if spec is not None and spec.origin is not None:
        root = Path(spec.origin).parent
        if (root / "bin" / "ucx_perftest").is_file():
            return root / "bin" / "ucx_perftest", root / "lib"
    found = shutil.which("ucx_perftest")
    return (Path(found), None) if found else None


def ucx_perftest_gbps(message_bytes: int, num_messages: int, tls: str = "tcp") -> float | None:
    """Bandwidth of `ucx_perftest -t tag_bw` (error handling on, as our endpoints have it)
    between two local processes over `tls`; None without the binary or when it fails."""
    found = find_ucx_perftest()
    if found is None:
        return None
    binary, lib_dir = found
    env = dict(os.environ, UCX_TLS=tls)
    if lib_dir is not None:
        env["LD_LIBRARY_PATH"] = f"{lib_dir}:{env.get('LD_LIBRARY_PATH', '')}"
    port = _free_port()
    num_warmup = max(4, num_messages // 8)
    args = ["-t", "tag_bw", "-e", "-s", str(message_bytes), "-n", str(num_messages)]
    args += ["-w", str(num_warmup)]
    args += ["-p", str(port)]
    server = subprocess.Popen([binary, *args], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        for _ in range(20):  # until the server listens
            time.sleep(0.25)
            client = subprocess.run(
                [binary, "127.0.0.1", *args],
                env=env, capture_output=True, text=True, timeout=PERFTEST_TIMEOUT_S,
            )  # fmt: skip
            if client.returncode == 0:
                return _parse_perftest(client.stdout)
            if server.poll() is not None:
                return None
        return None
    except subprocess.TimeoutExpired:
        return None
    finally:
        server.kill()
        server.wait(10)


def _parse_perftest(output: str) -> float | None:
    """GB/s of the "Final:" line: iterations, 3 latencies, then average and overall MB/s."""
    for line in output.splitlines():
        if line.startswith("Final:"):
            return float(line.split()[6]) * _UCX_MBYTE / 1e9
    return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def peer_copy_gbps(spec: TransferSpec, src: torch.device, dst: torch.device) -> float:
    """GB/s of copying the request's bytes layer by layer from `src` to `dst` (best of 3)."""
    num_layers, layer_bytes = spec.layout.num_layers, spec.layer_bytes
    src_buf = torch.empty(num_layers, layer_bytes, dtype=torch.uint8, device=src)
    dst_buf = torch.empty(num_layers, layer_bytes, dtype=torch.uint8, device=dst)
    best_s = float("inf")
    for _ in range(4):  # the first is a warm-up
        synchronize(src)
        synchronize(dst)
        start_s = time.perf_counter()
        for layer_idx in range(num_layers):
            dst_buf[layer_idx].copy_(src_buf[layer_idx], non_blocking=True)
        synchronize(src)
        synchronize(dst)
        best_s = min(best_s, time.perf_counter() - start_s)
    return spec.request_bytes / best_s / 1e9


@dataclass
class PackRates:
    """GB/s (bytes of the packed layer per second) of one in-process op on one layer."""

    per_call: float  # wall clock of back-to-back calls: host dispatch and launch included
    on_gpu: float | None  # CUDA: the same calls replayed from a CUDA graph (the GPU's time)


def pack_unpack_gbps(
    spec: TransferSpec, device: torch.device, impl: str = "auto", reps: int = 20
) -> tuple[PackRates, PackRates, float | None]:
    """pack_layer's and unpack_layer's rates on one layer of the request (warm buffers, block
    ids checked and on the device once, as the node does per request), and, on CUDA, a plain
    device copy of the same bytes timed the same way (graph replay): their ceiling."""
    k_cache, v_cache = spec.src_layer(spec.base_layer(device), 0)
    block_ids = random.Random(0).sample(range(spec.num_pool_blocks), spec.num_blocks)
    ids = check_block_ids(block_ids, k_cache.shape[0], device, unique=True)
    staging = torch.empty(spec.layer_bytes, dtype=torch.uint8, device=device)
    ops = (
        lambda: pack_layer(k_cache, v_cache, ids, staging, impl),
        lambda: unpack_layer(staging, k_cache, v_cache, ids, impl),
    )
    rates = [PackRates(_wall_gbps(op, spec.layer_bytes, device, reps), None) for op in ops]
    if device.type != "cuda":
        return rates[0], rates[1], None
    for rate, op in zip(rates, ops):
        rate.on_gpu = _graph_gbps(op, spec.layer_bytes, reps)
    copy_dst = torch.empty_like(staging)
    copy_gbps = _graph_gbps(lambda: copy_dst.copy_(staging), spec.layer_bytes, reps)
    return rates[0], rates[1], copy_gbps


def _wall_gbps(op: Callable[[], object], num_bytes: int, device: torch.device, reps: int) -> float:
    op()
    synchronize(device)
    start_s = time.perf_counter()
    for _ in range(reps):
        op()
    synchronize(device)
    return reps * num_bytes / (time.perf_counter() - start_s) / 1e9


def _graph_gbps(op: Callable[[], object], num_bytes: int, reps: int) -> float:
    """`reps` calls of `op` captured in one CUDA graph, best of 5 replays (GPU time only)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture (Triton compiles, caches fill)
        op()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            op()
    best_s = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best_s = min(best_s, start.elapsed_time(end) / 1e3)
    return reps * num_bytes / best_s / 1e9
