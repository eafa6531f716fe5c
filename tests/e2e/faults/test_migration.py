"""A decode node killed mid-stream: the router migrates its requests (prompt + tokens already
streamed) to the other decode node; every client stream finishes with exactly the tokens of an
undisturbed run, greedy and seeded."""

from __future__ import annotations

import asyncio

import pytest

from tests.e2e.faults.fault_tools import free_blocks_settled
from tests.e2e.faults.table import FaultRow, record
from tests.e2e.registry_cluster import RegistryCluster, eventually

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

NUM_TOKENS = 200
PROMPTS = [[5 + i, 17, 33, 2 * i + 40, 61, 7, 99, 120 + i] for i in range(4)]


async def _streams(client, sampling: dict, on_token=None) -> list[list[int]]:
    async def one(i: int) -> list[int]:
        tokens: list[int] = []
        request = dict(prompt_token_ids=PROMPTS[i], max_tokens=NUM_TOKENS, ignore_eos=True)
        async for chunk in client.generate(timeout_s=120, **request, **sampling):
            tokens.extend(chunk.token_ids)
            if on_token is not None:
                on_token(i, len(tokens))
        return tokens

    return await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))


@pytest.mark.parametrize(
    "sampling",
    [{"temperature": 0.0}, {"temperature": 0.8, "top_p": 0.95, "seed": 1234}],
    ids=["greedy", "seeded"],
)
def test_decode_killed_mid_stream_is_migrated(tmp_path, sampling):
    with RegistryCluster(tmp_path) as cluster:
        cluster.start_nodes(prefill=1, decode=2)

        async def main():
            async with cluster.router(policy="round_robin") as (router, client):
                await eventually(lambda: len(router.registry.decode_nodes) == 2, 20)
                undisturbed = await _streams(client, sampling)
                assert all(len(t) == NUM_TOKENS for t in undisturbed)
                killed = asyncio.Event()

                def on_token(_i: int, num_tokens: int) -> None:
                    if num_tokens >= 40 and not killed.is_set():
                        killed.set()
                        cluster.kill("decode-1")  # SIGKILL, mid-stream

                disturbed = await _streams(client, sampling, on_token)
                return undisturbed, disturbed, router.stats

        undisturbed, disturbed, stats = asyncio.run(asyncio.wait_for(main(), 240))
        settled = free_blocks_settled(cluster, ["decode-0", "prefill-0"])
        record(FaultRow(
            f"decode killed mid-stream (SIGKILL), {sampling_name(sampling)}: migrated",
            len(disturbed), sum(t == u for t, u in zip(disturbed, undisturbed)), 0,
            sum(total - free for free, total in settled.values()), 0,
            f"migrations={stats.num_migrations}; tokens identical to the undisturbed run",
        ))  # fmt: skip
        assert disturbed == undisturbed
        assert stats.num_migrations >= 1  # decode-1 held some of the 4 streams
        assert all(free == total for free, total in settled.values()), settled


def sampling_name(sampling: dict) -> str:
    return "greedy" if sampling["temperature"] == 0.0 else "seeded"
