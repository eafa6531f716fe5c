"""The decode side of `pd-bench transfer`: reserve blocks, receive one request's KV, check it.

    open()          zero the cache, reserve random block ids, start a receiver; its ticket
                    (the receiver is awaited at once: the time it finished, device work
                    included, is what end to end ends on)
    result(src_ids) once finished: state, bytes, finish time, and whether every layer landed
                    byte for byte (against the prefill side's KV, rebuilt from the seed)

`decode_process` runs it in a process of its own, driven over a Pipe by the prefill side.
"""

from __future__ import annotations

import asyncio
import random
import socket
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from benchmarks.transfer.spec import TransferSpec, synchronize
from cache_transfer import (
    CudaIpcSharing,
    KVReceiver,
    KVTransferManager,
    TransferState,
    make_transport,
)

TIMEOUT_S = 60.0


@dataclass(frozen=True)
class RequestResult:
    state: int  # TransferState
    num_bytes: int
    finished_s: float  # time.perf_counter() (CLOCK_MONOTONIC: comparable across processes)
    exact: bool
    error: str


class DecodeSide:
    def __init__(self, spec: TransferSpec, device: torch.device) -> None:
        """Call inside the running event loop."""
        self.spec = spec
        self.device = device
        self._caches = spec.empty_caches(device)
        sharing = CudaIpcSharing() if spec.in_place and device.type == "cuda" else None
        self._manager = KVTransferManager(
            make_transport(spec.transport), spec.layout, self._caches, sharing=sharing
        )
        self._rng = random.Random(spec.seed + 1)
        self._receiver: KVReceiver | None = None
        self._finished: asyncio.Task[float] | None = None

    def open(self) -> bytes:
        """A receiver for the next request; its serialized ticket."""
        for k_cache, v_cache in self._caches:
            k_cache.zero_()
            v_cache.zero_()
        synchronize(self.device)
        dst_block_ids = self._rng.sample(range(self.spec.num_pool_blocks), self.spec.num_blocks)
        receiver = self._manager.create_receiver(dst_block_ids, self.spec.num_tokens, TIMEOUT_S)
        self._receiver = receiver
        self._finished = asyncio.get_running_loop().create_task(self._finish(receiver))
        return receiver.ticket().SerializeToString()

    async def result(self, src_block_ids: list[int]) -> RequestResult:
        assert self._receiver is not None and self._finished is not None
        receiver, finished_s = self._receiver, await self._finished
        exact = receiver.state == TransferState.SUCCESS and self._landed_exactly(
            src_block_ids, receiver.dst_block_ids[: self.spec.num_blocks]
        )
        return RequestResult(
            int(receiver.state),
            receiver.num_bytes_received,
            finished_s,
            exact,
            receiver.error or "",
        )

    async def close(self) -> None:
        await self._manager.close()

    async def _finish(self, receiver: KVReceiver) -> float:
        await receiver.wait()
        synchronize(self.device)  # the last unpack included
        return time.perf_counter()

    def _landed_exactly(self, src_block_ids: list[int], dst_block_ids: list[int]) -> bool:
        base = self.spec.base_layer(self.device)
        src_ids = torch.tensor(src_block_ids, device=self.device)
        dst_ids = torch.tensor(dst_block_ids, device=self.device)
        for layer_idx, (k_cache, v_cache) in enumerate(self._caches):
            src_k, src_v = self.spec.src_layer(base, layer_idx)
            for src, dst in ((src_k, k_cache), (src_v, v_cache)):
                want = src.index_select(0, src_ids).view(torch.uint8)
                if not torch.equal(dst.index_select(0, dst_ids).view(torch.uint8), want):
                    return False
        return True


def decode_process(conn: Connection, spec: TransferSpec, device: str) -> None:
    """Child process: serve the prefill side's commands until "stop"."""
    torch.set_num_threads(1)  # pack/unpack run on the event loop; leave cores to the wire
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    asyncio.run(_serve(conn, spec, torch.device(device)))


async def _serve(conn: Connection, spec: TransferSpec, device: torch.device) -> None:
    side = DecodeSide(spec, device)
    try:
        while True:
            command, *args = await asyncio.to_thread(_recv, conn)
            if command == "ticket":
                conn.send(side.open())
            elif command == "result":
                conn.send(await side.result(*args))
            elif command == "raw_ucx":
                from benchmarks.transfer.raw_ucx import raw_ucx_sink  # ucxx only when asked

                await raw_ucx_sink(conn, device, *args)
                conn.send("ok")
            elif command == "socket":
                await asyncio.to_thread(socket_sink, *args)
                conn.send("ok")
            else:
                return
    finally:
        await side.close()


def _recv(conn: Connection) -> tuple:
    if not conn.poll(TIMEOUT_S):
        raise TimeoutError(f"the prefill side sent nothing for {TIMEOUT_S:.0f}s")
    return conn.recv()


def socket_sink(port: int, num_bytes: int, reps: int) -> None:
    """Receive `num_bytes` `reps` times from 127.0.0.1:`port` into one buffer; ack each."""
    buf = memoryview(bytearray(num_bytes))
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S) as sock:
        for _ in range(reps):
            got = 0
            while got < num_bytes:
                got += sock.recv_into(buf[got:], num_bytes - got)
            sock.sendall(b"k")
