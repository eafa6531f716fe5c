"""The rank processes of `pd-bench transfer --src-tp A --dst-tp B`: one process per rank of
each side, each with its own transport and transfer manager over its head slice of the KV, as
a tensor-parallel node's ranks have (cache_transfer/tp/).

```
RankPeer(spec, role, rank, world_size, device)   a child process running RankSide
decode rank 0   open(None, ranks) -> the ticket: a TPReceiver over every decode rank
decode rank j   open(ticket, ranks): a FanIn for the routes reaching it
prefill rank i  prepare(ticket, src_ids): its routes (FanOutSender), every layer packed, the
                routes acked ("ready"); go(): hand every layer over at once (one call: what a
                prefill node does with the layers packed by then), rank 0 then the first
                token; its start time and outcome
decode rank j   result(src_ids): when its last layer landed (device work included), bytes,
                and whether its heads of the KV landed byte for byte
```
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import random
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from benchmarks.transfer.decode import TIMEOUT_S
from benchmarks.transfer.peer import first_visible
from benchmarks.transfer.spec import TransferSpec, synchronize
from cache_transfer import KVTransferManager, TransferState, make_transport, pack_layer
from cache_transfer.tp import DecodeRank, FanIn, FanOutSender, RankHeads, TPReceiver

START_TIMEOUT_S = 300.0  # a rank process's start (torch imported: slow on a loaded host)


@dataclass(frozen=True)
class RankResult:
    state: int  # TransferState
    time_s: float  # prefill: when it began handing layers over; decode: when all had landed
    num_bytes: int
    exact: bool
    error: str


def rank_heads(spec: TransferSpec, world_size: int) -> list[RankHeads]:
    """The engine's kv-head partition of `world_size` ranks (engine/distributed/tp_shard)."""
    from engine.distributed.tp_shard import partition_model
    from engine.model.synthetic import parse_synthetic

    arch = parse_synthetic(spec.layout.model)
    shards = [partition_model(arch, r, world_size).shard for r in range(world_size)]
    return [RankHeads(s.rank, s.kv_head_start, s.kv_head_end) for s in shards]


class RankPeer:
    """One rank, in a child process driven over a Pipe (on CUDA its GPU is its cuda:0, as
    ucxx's progress thread assumes, every GPU visible: peer.py's `first_visible`)."""

    def __init__(self, spec: TransferSpec, role: str, heads: RankHeads, device: str) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        own = "cuda:0" if device.startswith("cuda") else device
        self._process = ctx.Process(
            target=rank_process, args=(child_conn, spec, role, heads, own), daemon=True
        )
        with first_visible(torch.device(device)):
            self._process.start()

    async def ask(self, *command: object) -> Any:
        self._conn.send(command)
        return await self.answer()

    async def answer(self, timeout_s: float = TIMEOUT_S) -> Any:
        """The process's next message (its first: its KV transport address)."""

        def recv() -> Any:
            deadline_s = time.monotonic() + timeout_s
            while not self._conn.poll(0.5):
                if not self._process.is_alive():
                    raise RuntimeError(f"a rank process died (exit {self._process.exitcode})")
                if time.monotonic() > deadline_s:
                    raise TimeoutError(f"a rank process answered nothing for {timeout_s}s")
            return self._conn.recv()

        return await asyncio.to_thread(recv)

    async def close(self) -> None:
        if self._process.is_alive():
            self._conn.send(("stop",))
        await asyncio.to_thread(self._process.join, TIMEOUT_S)
        if self._process.is_alive():
            self._process.kill()


def rank_process(
    conn: Connection, spec: TransferSpec, role: str, heads: RankHeads, device: str
) -> None:
    torch.set_num_threads(1)  # pack/unpack on the event loop; leave cores to the wire
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    asyncio.run(_serve(conn, RankSide(spec, role, heads, torch.device(device))))


async def _serve(conn: Connection, side: RankSide) -> None:
    await side.start()
    conn.send(side.address)
    try:
        while True:
            command, *args = await asyncio.to_thread(conn.recv)
            if command == "stop":
                return
            conn.send(await getattr(side, command)(*args))
    finally:
        await side.close()


class RankSide:
    def __init__(self, spec: TransferSpec, role: str, heads: RankHeads, device: torch.device):
        self.spec, self.role, self.heads, self.device = spec, role, heads, device
        self.layout = spec.layout.with_heads(heads.kv_head_end - heads.kv_head_start)
        full = spec.src_caches(device)  # the whole model's KV, this rank's heads cut from it
        cut = slice(heads.kv_head_start, heads.kv_head_end)
        self._src = [(k[:, :, cut], v[:, :, cut]) for k, v in full]
        # its own pool (a whole-heads cut is a view of `full`: decode zeroes it)
        self._caches = [
            (
                k.clone(memory_format=torch.contiguous_format),
                v.clone(memory_format=torch.contiguous_format),
            )
            for k, v in self._src
        ]
        if role == "decode":
            for k, v in self._caches:
                k.zero_()
                v.zero_()
        self._rng = random.Random(spec.seed + 1)
        self._fan_out: FanOutSender | None = None
        self._packed: list[tuple[int, torch.Tensor]] = []
        self._finished: asyncio.Task[float] | None = None
        self._receiving: Any = None  # decode: rank 0's TPReceiver, another's FanIn
        self._dst_ids: list[int] = []

    async def start(self) -> None:
        caches = self._caches if self.role == "decode" else None
        self._manager = KVTransferManager(make_transport(self.spec.transport), self.layout, caches)
        self.address = self._manager.address

    async def open(self, ticket: bytes | None, ranks: list[tuple[RankHeads, str]]) -> bytes:
        from pdserve.v1 import node_pb2

        spec = self.spec
        decode_ranks = [DecodeRank(h, address, "") for h, address in ranks]
        timeouts = (TIMEOUT_S, None)
        if ticket is None:  # decode rank 0: reserve, issue the ticket
            dst_ids = self._rng.sample(range(spec.num_pool_blocks), spec.num_blocks)
            receiver = TPReceiver(self._manager, spec.layout, decode_ranks, self._caches,
                                  dst_ids, spec.num_tokens, timeouts)  # fmt: skip
            receiver.seal()
            self._receiving, self._dst_ids = receiver, dst_ids
            group = receiver.group
        else:
            parsed = node_pb2.TransferTicket.FromString(ticket)
            self._dst_ids = list(parsed.dst_block_ids)
            own = decode_ranks[self.heads.rank]
            fan_in = FanIn(self._manager, parsed, own, self._caches, spec.layout, timeouts)
            self._receiving, group = fan_in, fan_in.group
        self._finished = asyncio.get_running_loop().create_task(self._land(group))
        return ticket if ticket is not None else self._receiving.ticket().SerializeToString()

    async def prepare(self, ticket: bytes, src_ids: list[int], src: list[RankHeads]) -> str:
        from pdserve.v1 import node_pb2

        parsed = node_pb2.TransferTicket.FromString(ticket)
        fan_out = FanOutSender.create(self._manager, parsed, self.spec.layout, self.heads, src,
                                      TIMEOUT_S)  # fmt: skip
        fan_out.seal()  # (rank 0: the other ranks' shares are this benchmark's to gather)
        self._fan_out = fan_out
        self._packed = []
        for layer_idx, (k, v) in enumerate(self._caches):
            out = torch.empty(self.layout.layer_bytes(len(src_ids)), dtype=torch.uint8,
                              device=self.device)  # fmt: skip
            self._packed.append((layer_idx, pack_layer(k, v, src_ids, out)))
        synchronize(self.device)
        fan_out.start()
        while any(s.state < TransferState.WAITING for _, s in fan_out.routes):
            if fan_out.finished:
                return f"failed: {fan_out.error}"
            await asyncio.sleep(0.001)
        return "ready"

    async def go(self) -> RankResult:
        fan_out = self._fan_out
        assert fan_out is not None
        start_s = time.perf_counter()
        if fan_out.routes:
            await fan_out.send_packed_layers(self._packed)
            if self.heads.rank == 0:
                await fan_out.send_first_token(1)
        state = await fan_out.wait() if fan_out.routes else TransferState.SUCCESS
        return RankResult(int(state), start_s, fan_out.num_bytes_sent, True, fan_out.error or "")

    async def result(self, src_ids: list[int]) -> RankResult:
        assert self._finished is not None and self._receiving is not None
        finished_s = await self._finished
        group = self._receiving.group
        dst_ids = self._dst_ids[: len(src_ids)]
        exact = group.state == TransferState.SUCCESS and self._landed_exactly(src_ids, dst_ids)
        num_bytes = self._receiving.num_bytes_received
        return RankResult(int(group.state), finished_s, num_bytes, exact, group.error or "")

    async def _land(self, group: Any) -> float:
        await group.wait()
        synchronize(self.device)  # the last unpack included
        return time.perf_counter()

    def _landed_exactly(self, src_ids: list[int], dst_ids: list[int]) -> bool:
        src = torch.tensor(src_ids, device=self.device)
        dst = torch.tensor(dst_ids, device=self.device)
        for (k_src, v_src), (k, v) in zip(self._src, self._caches, strict=True):
            for want, got in ((k_src, k), (v_src, v)):  # as bytes (random bytes hold NaNs)
                landed = got.index_select(0, dst).view(torch.uint8)
                if not torch.equal(landed, want.index_select(0, src).view(torch.uint8)):
                    return False
        return True

    async def close(self) -> None:
        await self._manager.close()
