"""Nodes that die or hang while requests are in flight, and clients that cancel at random
points: every client gets its tokens or a clear status in time, the surviving nodes free every
KV block, nothing crashes, RSS stays bounded (FaultCluster.check, one table row per fault)."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from tests.e2e.faults.fault_cluster import TRANSFER_TIMEOUT_S
from tests.e2e.faults.fault_tools import burst, prompts, wait_registered

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

DEADLINE_S = 40.0  # each client's deadline
ALL = ["prefill-0", "decode-0", "decode-1"]


def strike_at_first_token(action) -> callable:
    """An on_chunk callback that runs `action()` once, when any client sees its first token
    (the prefill node's: transfers of the burst are in flight)."""
    struck = []

    def on_chunk(_outcome) -> None:
        if not struck:
            struck.append(True)
            action()

    return on_chunk


def kill_mid_transfer(cluster, victim: str, seed: int, max_tokens: int, notes, **router_config):
    """SIGKILL `victim` when the burst's first token arrives; every client still completes
    (re-routed); the survivors free every block. `notes(router)` is the table row's note."""

    async def main():
        async with cluster.router(**router_config) as (router, client):
            await wait_registered(router)
            kill = strike_at_first_token(lambda: cluster.kill(victim))
            outcomes = await burst(client, prompts(8, seed=seed, min_len=40, max_len=60),
                                   DEADLINE_S, max_tokens=max_tokens, on_chunk=kill)  # fmt: skip
            return outcomes, notes(router)

    outcomes, note = asyncio.run(main())
    try:
        cluster.check(f"{victim.split('-')[0]} killed mid-transfer (SIGKILL)", outcomes,
                      [n for n in ALL if n != victim], DEADLINE_S,
                      notes=note, min_completed=len(outcomes))  # fmt: skip
    finally:
        cluster.restart(victim)


def test_decode_killed_mid_transfer(fault_cluster):
    kill_mid_transfer(
        fault_cluster, "decode-1", seed=1, max_tokens=24, policy="round_robin",
        notes=lambda router: f"rerouted={router.stats.num_retries + router.stats.num_migrations}",
    )  # fmt: skip


def test_prefill_killed_mid_transfer(fault_cluster):
    kill_mid_transfer(
        fault_cluster, "prefill-0", seed=2, max_tokens=16,
        notes=lambda router: f"prefill failures={router.stats.num_prefill_failures}",
    )  # fmt: skip


def test_prefill_frozen_mid_transfer_times_out(fault_cluster):
    """The transfer timeout: the prefill node stops (SIGSTOP) with hand-offs in flight; the
    decode nodes give up after TRANSFER_TIMEOUT_S and prefill locally; thawed, the prefill
    node frees what it held."""
    cluster = fault_cluster

    async def main():
        async with cluster.router() as (router, client):
            await wait_registered(router)
            freeze = strike_at_first_token(lambda: cluster.freeze("prefill-0"))
            try:
                outcomes = await burst(client, prompts(8, seed=3, min_len=40, max_len=60),
                                       DEADLINE_S, max_tokens=16, on_chunk=freeze)  # fmt: skip
            finally:
                cluster.thaw("prefill-0")
            return outcomes

    outcomes = asyncio.run(main())
    slowest = max(o.elapsed_s for o in outcomes)
    cluster.check("transfer timeout (prefill SIGSTOP mid-transfer)", outcomes, ALL,
                  DEADLINE_S, notes=f"slowest {slowest:.1f} s", min_completed=len(outcomes))  # fmt: skip
    assert slowest < DEADLINE_S / 2  # the 3 s transfer timeout, not the client's deadline


def test_hung_decode_node(fault_cluster):
    """A decode node stops (SIGSTOP) for a few seconds mid-stream, then goes on (SIGCONT)."""
    cluster = fault_cluster
    hang_s = 2 * TRANSFER_TIMEOUT_S

    async def main():
        async with cluster.router(policy="round_robin") as (router, client):
            await wait_registered(router)
            loop = asyncio.get_running_loop()

            def freeze() -> None:
                cluster.freeze("decode-1")
                loop.call_later(hang_s, cluster.thaw, "decode-1")

            try:
                outcomes = await burst(client, prompts(8, seed=4, min_len=20, max_len=40),
                                       DEADLINE_S, max_tokens=24,
                                       on_chunk=strike_at_first_token(freeze))  # fmt: skip
            finally:
                cluster.thaw("decode-1")
            return outcomes

    outcomes = asyncio.run(main())
    cluster.check(f"hung decode (SIGSTOP {hang_s:.0f} s, SIGCONT)", outcomes, ALL, DEADLINE_S,
                  min_completed=len(outcomes))  # fmt: skip


def test_cancel_storm(fault_cluster):
    """50 requests, each cancelled by its client at a seeded random point (before the ticket,
    during the prefill, the hand-off, or the decode)."""
    cluster = fault_cluster
    rng = random.Random(15)
    cancels = [rng.uniform(0.0, 1.5) for _ in range(50)]

    async def main():
        async with cluster.router() as (router, client):
            await wait_registered(router)
            return await burst(client, prompts(50, seed=5, min_len=8, max_len=40),
                               DEADLINE_S, max_tokens=64, cancel_after_s=cancels)  # fmt: skip

    outcomes = asyncio.run(main())
    num_cancelled = sum(o.code == grpc.StatusCode.CANCELLED for o in outcomes)
    cluster.check("cancel storm (50 random cancels, seeded)", outcomes, ALL, DEADLINE_S,
                  notes=f"cancelled={num_cancelled}", min_completed=0)  # fmt: skip
    idle = {n: cluster.stats(n) for n in ALL}
    assert all(s.num_running_requests == s.num_waiting_requests == 0 for s in idle.values())
    assert all(s.num_pending_transfers == 0 for s in idle.values()), idle
