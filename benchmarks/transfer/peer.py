"""`DecodePeer`: how `pd-bench transfer`'s prefill side drives its decode side.

DecodePeer(spec, device)   a child process running DecodeSide (driven over a Pipe), or
                           DecodeSide in this process for the in-process `local` transport
ticket() / result(src_ids) one request: reserve and open a receiver; its outcome, checked
socket_gbps(...)           the plain-socket ceiling between the same two processes
raw_ucx_gbps(...)          plain ucxx sends of the same bytes between them (GPU to GPU on CUDA)
close()                    stop the child (killed if it does not stop)
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import socket
import time
from collections.abc import Iterator
from typing import Any

import torch

from benchmarks.transfer.decode import TIMEOUT_S, DecodeSide, RequestResult, decode_process
from benchmarks.transfer.spec import TransferSpec
from pdserve.v1 import node_pb2


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
        with first_visible(device):
            self._process.start()

    @property
    def in_process(self) -> bool:
        return self._side is not None

    async def ticket(self) -> node_pb2.TransferTicket:
        raw = self._side.open() if self._side is not None else await self._ask("ticket")
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

    async def raw_ucx_gbps(
        self, device: torch.device, num_layers: int, layer_bytes: int, reps: int = 3
    ) -> float:
        """Plain ucxx sends of the same bytes into the decode process (its device): GB/s."""
        from benchmarks.transfer.raw_ucx import raw_ucx_gbps

        self._conn.send(("raw_ucx", num_layers, layer_bytes, reps))
        port = await self._recv()
        gbps = await raw_ucx_gbps(port, device, num_layers, layer_bytes, reps)
        assert await self._recv() == "ok"
        return gbps

    async def close(self) -> None:
        if self._side is not None:
            await self._side.close()
        elif self._process is not None:
            if self._process.is_alive():
                self._conn.send(("stop",))
            await asyncio.to_thread(self._process.join, TIMEOUT_S)
            if self._process.is_alive():
                self._process.kill()

    async def _ask(self, *command: object) -> Any:  # what the pipe carries
        self._conn.send(command)
        return await self._recv()

    async def _recv(self) -> Any:
        def recv() -> Any:
            assert self._process is not None
            deadline_s = time.monotonic() + TIMEOUT_S
            while not self._conn.poll(0.5):
                if not self._process.is_alive():
                    raise RuntimeError(f"the decode process died (exit {self._process.exitcode})")
                if time.monotonic() > deadline_s:
                    raise TimeoutError(f"the decode process answered nothing for {TIMEOUT_S}s")
            return self._conn.recv()

        return await asyncio.to_thread(recv)


@contextlib.contextmanager
def first_visible(device: torch.device) -> Iterator[None]:
    """Processes spawned inside see `device` as cuda:0 (what ucxx's progress thread assumes),
    every GPU still visible so cuda_ipc reaches the peer's memory."""
    if device.type != "cuda":
        yield
        return
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = saved.split(",") if saved else [str(i) for i in range(torch.cuda.device_count())]
    index = device.index or 0
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join([ids[index], *ids[:index], *ids[index + 1 :]])
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES")
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved
