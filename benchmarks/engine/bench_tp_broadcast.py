"""The per-step cost of handing a step's inputs from rank 0 to the other tensor-parallel ranks,
two ways: the shared-memory broadcast the engine uses (engine/distributed/shm_broadcast.py)
and one packed tensor over the process group (its size, then its bytes, with
`torch.distributed.broadcast`).

    python -m benchmarks.engine.bench_tp_broadcast [--world-size 2] [--steps 300] [--rounds 3]

Each rank runs a step loop: rank 0 sends the step's message (a real step's `HostStep` arrays of
the case's sizes: token ids, positions, slots, lengths, logits rows, block tables), the others
decode it, then all join one small all-reduce (a step's first collective: the ranks line up).
Per step: the latency from rank 0 starting its send to rank 1 holding the decoded message (one
clock, CLOCK_MONOTONIC), and rank 0's time in its send call. The two ways take turns within
each round, so both see the same machine load. CPU, gloo.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import statistics
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from engine.distributed.process_group import connect_store, create_store
from engine.distributed.shm_broadcast import ShmBroadcast
from engine.distributed.step_message import StepMessage


@dataclass(frozen=True)
class Case:
    label: str
    num_tokens: int
    num_rows: int
    width: int  # block-table columns
    num_sampling: int


CASES = (
    Case("decode batch 1, context 1K", 1, 1, 64, 1),
    Case("decode batch 32, context 1K", 32, 32, 64, 32),
    Case("decode batch 128, context 4K", 128, 128, 256, 128),
    Case("prefill 2K + 8 decodes", 2056, 9, 128, 9),
)
WAYS = ("shm", "packed tensor")


def message(case: Case) -> StepMessage:
    """A step's message of `case`'s sizes (the values do not matter to the cost)."""
    rng = np.random.default_rng(0)
    t, r = case.num_tokens, case.num_rows
    sizes = (t, t, t, r, r + 1, case.num_sampling, r * case.width, 0, 0)
    arrays = tuple(rng.integers(0, 1 << 20, n, dtype=np.int64) for n in sizes)
    return StepMessage((case.width, 1, 0), arrays)


def _send(way: str, msg: StepMessage, shm: ShmBroadcast) -> None:
    if way == "shm":
        shm.write(msg.encode(), 60.0)
        return
    payload = np.concatenate([np.frombuffer(v, np.uint8) for v in msg.encode()])
    dist.broadcast(torch.tensor([payload.size], dtype=torch.int64), src=0)
    dist.broadcast(torch.from_numpy(payload), src=0)


def _receive(way: str, shm: ShmBroadcast) -> StepMessage | None:
    if way == "shm":
        return StepMessage.decode(shm.read())
    size = torch.empty(1, dtype=torch.int64)
    dist.broadcast(size, src=0)
    payload = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(payload, src=0)
    return StepMessage.decode(bytearray(payload.numpy().tobytes()))


def _steps(way: str, rank: int, msg: StepMessage, shm: ShmBroadcast, steps: int) -> list[float]:
    """Rank 0: its time in the send call per step; other ranks: each step's latency (rank 0's
    send started -> this rank decoded the message; one clock: CLOCK_MONOTONIC)."""
    token = torch.zeros(8)
    times = []
    for _ in range(steps):
        start = time.perf_counter_ns()
        if rank == 0:
            _send(way, StepMessage((start, *msg.ints[1:]), msg.arrays), shm)
            times.append((time.perf_counter_ns() - start) / 1e9)
        else:
            got = _receive(way, shm)
            assert got is not None
            times.append((time.perf_counter_ns() - got.ints[0]) / 1e9)
        dist.all_reduce(token)  # the step's first collective: the ranks line up
    return times


def _rank(rank: int, world: int, port: int, args: dict[str, Any], out: Any) -> None:
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=120)
    store = connect_store(port, world, timeout.total_seconds())
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    path = [ShmBroadcast.create(world - 1).path if rank == 0 else ""]
    dist.broadcast_object_list(path, src=0)
    shm = ShmBroadcast(path[0], world - 1, reader=None if rank == 0 else rank - 1)
    dist.barrier()
    times: dict[tuple[str, str], list[float]] = {}
    for case in CASES:
        msg = message(case)
        for _ in range(args["rounds"]):  # the ways in turn: both see the same machine load
            for way in WAYS:
                _steps(way, rank, msg, shm, 10)  # warm-up
                times.setdefault((case.label, way), []).extend(
                    _steps(way, rank, msg, shm, args["steps"])
                )
    if rank <= 1:
        out.put((rank, times))
    dist.barrier()
    if rank == 0:
        shm.unlink()
    shm.close()
    dist.destroy_process_group()


def _us(times: list[float]) -> str:
    ordered = sorted(times)
    return (
        f"{statistics.median(ordered) * 1e6:.0f} us ({ordered[int(0.9 * len(ordered))] * 1e6:.0f})"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_tp_broadcast", description=__doc__.split("\n")[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=300, help="timed steps per round")
    p.add_argument("--rounds", type=int, default=3, help="rounds per case and way (best kept)")
    args = p.parse_args(argv)
    ctx = mp.get_context("spawn")
    # The rendezvous store lives here, on a port it bound itself; every rank is its client.
    store = create_store(args.world_size, timeout_s=120)
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_rank, args=(r, args.world_size, store.port, vars(args), out))
        for r in range(args.world_size)
    ]
    for proc in procs:
        proc.start()
    results = dict(out.get(timeout=1800) for _ in range(2))
    for proc in procs:
        proc.join(timeout=60)
    del store
    print(f"step broadcast, rank 0 -> {args.world_size - 1} other ranks (CPU; gloo for the "
          f"packed tensor), {args.rounds} x {args.steps} steps per case and way, the ways in "
          "turn; latency: rank 0 starts sending -> rank 1 has decoded the message")  # fmt: skip
    print("| step | message | shm: latency median (p90) | packed tensor: latency median (p90) "
          "| rank 0's send call: shm / packed (median) |")  # fmt: skip
    print("|---|---|---|---|---|")
    for case in CASES:
        nbytes = sum(v.nbytes for v in message(case).encode())
        cells = [f"{_us(results[1][(case.label, way)])}" for way in WAYS]
        sends = " / ".join(
            f"{statistics.median(results[0][(case.label, w)]) * 1e6:.0f} us" for w in WAYS
        )
        print(f"| {case.label} | {nbytes / 1024:.1f} KiB | {cells[0]} | {cells[1]} | {sends} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
