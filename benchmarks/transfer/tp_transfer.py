"""`pd-bench transfer --src-tp A --dst-tp B`: one request's KV from a prefill node of A
tensor-parallel ranks to a decode node of B, every rank its own process, each prefill rank
sending its own kv heads straight to the decode rank(s) holding them (cache_transfer/tp/).

Per request: the decode ranks open the hand-off (rank 0 issues the ticket), the prefill ranks
pack every layer of their heads and handshake their routes (untimed), then all hand their
layers over at once; the time runs from the first prefill rank starting to the last decode
rank having its last layer in place (device work included). Printed beside the ceiling
measured in the same run: a torch copy of the same bytes GPU0 -> GPU1 on CUDA, a host copy on
the CPU. Devices (CUDA): prefill rank i on GPU i, decode rank j on GPU (A + j), modulo the
GPUs there are. Exit code 1 unless every rank's heads landed byte-exact.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

import torch

from benchmarks.transfer import ceilings as transfer_ceilings
from benchmarks.transfer.spec import TransferSpec
from benchmarks.transfer.tp_ranks import START_TIMEOUT_S, RankPeer, RankResult, rank_heads
from cache_transfer import TransferState


@dataclass(frozen=True)
class TPRun:
    transfer_s: float
    num_bytes: int
    exact: bool

    @property
    def gbps(self) -> float:
        return self.num_bytes / self.transfer_s / 1e9


def rank_devices(device: str, src_tp: int, dst_tp: int) -> tuple[list[str], list[str]]:
    if device == "cpu":
        return ["cpu"] * src_tp, ["cpu"] * dst_tp
    n = torch.cuda.device_count()
    return [f"cuda:{i % n}" for i in range(src_tp)], [f"cuda:{(src_tp + j) % n}" for j in range(dst_tp)]  # fmt: skip


async def run_tp_requests(
    spec: TransferSpec, src_tp: int, dst_tp: int, device: str, iters: int
) -> list[TPRun]:
    """`iters` requests after one warm-up."""
    src, dst = rank_heads(spec, src_tp), rank_heads(spec, dst_tp)
    src_devices, dst_devices = rank_devices(device, src_tp, dst_tp)
    prefill = [RankPeer(spec, "prefill", h, d) for h, d in zip(src, src_devices, strict=True)]
    decode = [RankPeer(spec, "decode", h, d) for h, d in zip(dst, dst_devices, strict=True)]
    try:
        for peer in prefill:
            await peer.answer(START_TIMEOUT_S)  # started (its address: none needs it)
        addresses = [await peer.answer(START_TIMEOUT_S) for peer in decode]
        ranks = list(zip(dst, addresses, strict=True))
        rng = random.Random(spec.seed)
        runs = [await _one(spec, prefill, decode, src, ranks, rng) for _ in range(iters + 1)]
        return runs[1:]
    finally:
        await asyncio.gather(*(peer.close() for peer in [*prefill, *decode]))


async def _one(spec, prefill, decode, src, ranks, rng) -> TPRun:  # noqa: ANN001
    ticket = await decode[0].ask("open", None, ranks)
    await asyncio.gather(*(peer.ask("open", ticket, ranks) for peer in decode[1:]))
    src_ids = rng.sample(range(spec.num_pool_blocks), spec.num_blocks)
    ready = await asyncio.gather(*(peer.ask("prepare", ticket, src_ids, src) for peer in prefill))
    if any(answer != "ready" for answer in ready):
        raise RuntimeError(f"a prefill rank could not start: {ready}")
    sent: list[RankResult] = await asyncio.gather(*(peer.ask("go") for peer in prefill))
    landed: list[RankResult] = await asyncio.gather(
        *(peer.ask("result", src_ids) for peer in decode)
    )
    failed = [r.error for r in [*sent, *landed] if r.state != TransferState.SUCCESS]
    if failed:
        raise RuntimeError(f"the hand-off failed: {failed}")
    transfer_s = max(r.time_s for r in landed) - min(r.time_s for r in sent)
    return TPRun(transfer_s, sum(r.num_bytes for r in landed), all(r.exact for r in landed))


def report_tp(spec: TransferSpec, src_tp: int, dst_tp: int, device: str, runs: list[TPRun]) -> bool:
    """Print the run beside its ceiling; True when every request landed byte-exact."""
    if device == "cuda" and torch.cuda.device_count() > 1:
        name, src_dev, dst_dev = "torch copy GPU0 -> GPU1", "cuda:0", "cuda:1"
    elif device == "cuda":
        name, src_dev, dst_dev = "torch copy on GPU0", "cuda:0", "cuda:0"
    else:
        name, src_dev, dst_dev = "host copy (memcpy)", "cpu", "cpu"
    ceiling = transfer_ceilings.peer_copy_gbps(spec, torch.device(src_dev), torch.device(dst_dev))
    best = max(runs, key=lambda r: r.gbps)
    print(f"{spec.describe()}; {spec.transport} on {device}, best of {len(runs)}")
    print(f"{'path':<52}{'GB/s':>8}{'% ceiling':>11}{'MiB':>8}{'ms':>9}")
    print(f"{name + ' (ceiling)':<52}{ceiling:>8.2f}{100:>10.0f}%")
    label = f"prefill TP {src_tp} -> decode TP {dst_tp}: every rank's heads"
    print(f"{label:<52}{best.gbps:>8.2f}{100 * best.gbps / ceiling:>10.0f}%"
          f"{best.num_bytes / 2**20:>8.1f}{best.transfer_s * 1e3:>9.2f}")  # fmt: skip
    exact = all(r.exact for r in runs)
    print(f"byte-exact: {'OK' if exact else 'FAILED'} ({len(runs)} requests x "
          f"{spec.layout.num_layers} layers, each decode rank's heads, into other block ids)")  # fmt: skip
    return exact
