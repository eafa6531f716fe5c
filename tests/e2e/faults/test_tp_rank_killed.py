"""A tensor-parallel decode node whose rank 1 is killed (SIGKILL) mid-stream: its rank 0 sees
it at once and stops the node (deregistered, exit 1, no process of it left behind), the router
migrates the node's streams to the other decode node, every client stream ends with exactly
the tokens of an undisturbed run, and nothing leaks on the surviving nodes. A rank that hangs
(SIGSTOP) in a collective does the same, found by --tp-step-timeout-s."""

from __future__ import annotations

import asyncio
import signal

import psutil
import pytest

from tests.e2e.faults.fault_tools import free_blocks_settled
from tests.e2e.faults.table import FaultRow, record
from tests.e2e.registry_cluster import RegistryCluster, eventually

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

NUM_TOKENS = 48
PROMPTS = [[5 + i, 17, 33, 2 * i + 40, 61, 7, 99, 120 + i] for i in range(4)]
STEP_TIMEOUT_S = 4.0


async def _streams(client, on_token=None) -> list[list[int]]:
    async def one(i: int) -> list[int]:
        tokens: list[int] = []
        request = dict(prompt_token_ids=PROMPTS[i], max_tokens=NUM_TOKENS, ignore_eos=True)
        async for chunk in client.generate(timeout_s=120, temperature=0.0, **request):
            tokens.extend(chunk.token_ids)
            if on_token is not None:
                on_token(len(tokens))
        return tokens

    return await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))


def _ranks(cluster: RegistryCluster, name: str) -> tuple[list[psutil.Process], psutil.Process]:
    """The node's processes (rank 0 first) and its rank 1."""
    rank0 = psutil.Process(cluster.nodes[name].process.pid)
    children = rank0.children(recursive=True)
    rank1 = next(p for p in children if "engine.tp_worker" in " ".join(p.cmdline()))
    return [rank0, *children], rank1


def _gone(processes: list[psutil.Process]) -> bool:
    alive = []
    for process in processes:
        try:
            if process.status() != psutil.STATUS_ZOMBIE:
                alive.append(process)
        except psutil.NoSuchProcess:
            pass
    return not alive


@pytest.mark.parametrize("fault", ["killed", "hung"])
def test_a_decode_rank_lost_mid_stream_stops_its_node_and_streams_migrate(tmp_path, fault):
    with RegistryCluster(tmp_path) as cluster:
        flags = dict(tensor_parallel_size=2, tp_step_timeout_s=STEP_TIMEOUT_S)
        cluster.start_nodes(decode=1, **flags)  # decode-0: two ranks
        cluster.start_nodes(prefill=1, decode=1)  # prefill-0, decode-1
        processes, rank1 = _ranks(cluster, "decode-0")

        async def main():
            async with cluster.router(policy="round_robin") as (router, client):
                await eventually(lambda: len(router.registry.decode_nodes) == 2, 30)
                undisturbed = await _streams(client)
                hit = asyncio.Event()

                def on_token(num_tokens: int) -> None:
                    if num_tokens >= 12 and not hit.is_set():
                        hit.set()
                        rank1.send_signal(signal.SIGKILL if fault == "killed" else signal.SIGSTOP)

                disturbed = await _streams(client, on_token)
                await eventually(lambda: len(router.registry.decode_nodes) == 1, 30)
                return undisturbed, disturbed, router.stats

        undisturbed, disturbed, stats = asyncio.run(asyncio.wait_for(main(), 300))
        code = cluster.nodes["decode-0"].process.wait(60)  # it stopped itself
        settled = free_blocks_settled(cluster, ["decode-1", "prefill-0"])
        pending = cluster.counters("num_pending_transfers")
        record(FaultRow(
            f"TP 2 decode rank 1 {fault} mid-stream: node stopped, streams migrated",
            len(disturbed), sum(t == u for t, u in zip(disturbed, undisturbed)), 0,
            sum(total - free for free, total in settled.values()), 0,
            f"migrations={stats.num_migrations}; exit code {code}",
        ))  # fmt: skip
        assert disturbed == undisturbed
        assert all(len(tokens) == NUM_TOKENS for tokens in disturbed)
        assert stats.num_migrations >= 1
        assert code == 1
        assert _gone(processes), [p.pid for p in processes if p.is_running()]
        assert cluster.registered_roles() == ["decode", "prefill"]
        assert all(free == total for free, total in settled.values()), settled
        assert pending == {"decode-1": 0, "prefill-0": 0}, pending
