"""Issue 39 item 3, the cross-tenant prefix-cache oracle: tenant A (API key 1) sends a prefix
plus a secret block; tenant B (API key 2) sends the same prefix plus candidate blocks and reads
`usage.cached_tokens`. Before tenants had their own cache namespace, the right guess showed one
block more of cached tokens than the wrong ones (48 against 32 with 16-token blocks). Now B's
hits are B's own: every candidate shows the same count, and the prefill node did the same
prefill work for each (its hit counter grows alike), so the time to the first token, which
follows that work, says nothing about A's secret either."""

from __future__ import annotations

import asyncio
import random

import pytest

from router.client import GenerationClient
from tests.e2e.faults.fault_tools import wait_registered
from tests.e2e.registry_cluster import BLOCK_SIZE, RPC_TIMEOUT_S

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

KEY_A = "tenant-a-key-" + "a" * 24
KEY_B = "tenant-b-key-" + "b" * 24


def _blocks(rng: random.Random, num_blocks: int) -> list[int]:
    return [rng.randrange(3, 500) for _ in range(num_blocks * BLOCK_SIZE)]


async def _cached(client: GenerationClient, prompt: list[int], **fields) -> int:
    result = await client.generate_all(
        prompt_token_ids=prompt, max_tokens=1, temperature=0.0, timeout_s=RPC_TIMEOUT_S, **fields
    )
    return result.usage.cached_tokens


def _hits(cluster) -> int:
    return cluster.stats("prefill-0").num_prefix_cache_hit_tokens


def test_a_tenant_learns_nothing_of_another_tenants_prompt(fault_cluster, tmp_path):
    cluster = fault_cluster
    keys = tmp_path / "api-keys"
    keys.write_text(f"{KEY_A}\n{KEY_B}\n")
    rng = random.Random(39_3)
    prefix, secret, tail = _blocks(rng, 2), _blocks(rng, 1), [7, 8]
    wrong = [_blocks(rng, 1) for _ in range(3)]

    async def main():
        async with cluster.router(api_key_file=str(keys)) as (router, _):
            await wait_registered(router)
            a = GenerationClient(router.address, api_key=KEY_A)
            b = GenerationClient(router.address, api_key=KEY_B)
            try:
                await _cached(a, prefix + secret + tail)
                own = await _cached(a, prefix + secret + tail)  # A's own hits still count
                await _cached(b, prefix + wrong[0] + tail)  # B's prefix now in B's cache
                seen = {}
                for name, guess in [
                    ("wrong-1", wrong[1]),
                    ("right", secret),
                    ("wrong-2", wrong[2]),
                ]:
                    before = await asyncio.to_thread(_hits, cluster)
                    cached = await _cached(b, prefix + guess + tail)
                    work = await asyncio.to_thread(_hits, cluster) - before
                    seen[name] = (cached, work)
                salted = await _cached(a, prefix + secret + tail, cache_salt="other")
                return own, seen, salted
            finally:
                await a.close()
                await b.close()

    own, seen, salted = asyncio.run(main())
    assert own == 3 * BLOCK_SIZE, own
    # The right guess looks like every wrong one: B's own prefix, never A's secret block.
    assert seen["right"] == seen["wrong-1"] == seen["wrong-2"] == (2 * BLOCK_SIZE,) * 2, seen
    # A client's cache_salt is a namespace of its own within the tenant's.
    assert salted == 0, salted
