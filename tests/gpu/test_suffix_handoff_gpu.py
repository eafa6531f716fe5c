"""Suffix-only hand-offs on one GPU (issue 38): a real 1P1D `pd-serve --device cuda` with a
cluster secret (received KV is then cached on the decode node) serves a conversation's second
turn by moving only its new blocks, written in place into the decode node's blocks (one GPU)
or sent over tcp, with exactly the greedy tokens of a colocated node with prefix caching off.

    PYTHONPATH=$PWD python -m pytest tests/gpu/test_suffix_handoff_gpu.py -q -p no:cacheprovider \\
        -o addopts=""
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets

import pytest
import torch

from pdserve.config import NodeConfig, SecurityConfig
from pdserve.grpc_security import open_channel
from pdserve.security import load_cluster_auth
from pdserve.v1 import node_pb2, node_pb2_grpc
from router.client import GenerationClient
from tests.e2e.cluster import Cluster

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available"),
    pytest.mark.timeout(900),
]

MODEL = "synthetic:smollm2-135m:layers=8"  # no tokenizer: token-id prompts
BLOCK_SIZE = 16
MAX_TOKENS = 12
REQUEST_TIMEOUT_S = 120.0


def turns() -> tuple[list[int], list[int]]:
    gen = torch.Generator().manual_seed(38)
    return (torch.randint(100, 49152, (400,), generator=gen).tolist(),
            torch.randint(100, 49152, (64,), generator=gen).tolist())  # fmt: skip


def converse(addr: str) -> tuple[list[int], list[int]]:
    """Turn 1, then turn 2 = turn 1 + its answer + new tokens; both answers."""
    first, new = turns()

    async def main() -> tuple[list[int], list[int]]:
        async with GenerationClient(addr) as client:
            one = await client.generate_all(prompt_token_ids=first, max_tokens=MAX_TOKENS,
                                            temperature=0.0, ignore_eos=True,
                                            timeout_s=REQUEST_TIMEOUT_S)  # fmt: skip
            two = await client.generate_all(
                prompt_token_ids=first + list(one.token_ids) + new, max_tokens=MAX_TOKENS,
                temperature=0.0, ignore_eos=True, timeout_s=REQUEST_TIMEOUT_S,
            )  # fmt: skip
        return list(one.token_ids), list(two.token_ids)

    return asyncio.run(main())


def decode_stats(cluster: Cluster, security: SecurityConfig) -> node_pb2.NodeStats:
    async def main() -> node_pb2.NodeStats:
        channel = open_channel(cluster.nodes["decode-0"], security, load_cluster_auth(security))
        try:
            stub = node_pb2_grpc.NodeStub(channel)
            return await stub.GetStats(node_pb2.GetStatsRequest(), timeout=10)
        finally:
            await channel.close()

    return asyncio.run(main())


def _write_in_place_off_flag() -> str:
    """The switch that turns writes in place off (a knob that defaults to True)."""
    (field,) = [f for f in dataclasses.fields(NodeConfig) if f.name == "kv_write_in_place"]
    return field.metadata["flag"] or "--kv-write-in-place"


def serve(flags: list[str], check=None) -> tuple[list[int], list[int]]:
    cluster = Cluster(["--model", MODEL, "--device", "cuda", "--dtype", "bfloat16",
                       "--num-kv-blocks", "2048", "--log-level", "warning", *flags]).start()  # fmt: skip
    try:
        answers = converse(cluster.router)
        if check is not None:
            check(cluster)
    finally:
        leftover = cluster.stop()
    assert not leftover, f"processes left behind: {leftover}"
    return answers


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "sent"])
def test_second_turn_moves_only_new_blocks_with_cold_tokens(tmp_path, in_place: bool) -> None:
    cold = serve(["--prefill", "0", "--decode", "1", "--no-prefix-caching"])
    secret = tmp_path / "secret"
    secret.write_text(secrets.token_hex(32) + "\n")
    security = SecurityConfig(cluster_secret_file=str(secret))
    first, new = turns()

    def check(cluster: Cluster) -> None:
        stats = decode_stats(cluster, security)
        held = (len(first) + MAX_TOKENS - 1) // BLOCK_SIZE  # turn 1's blocks D computed
        total = -(-(len(first) + MAX_TOKENS + len(new)) // BLOCK_SIZE)
        assert stats.num_kv_transfers == 2 and stats.num_local_prefills == 0, stats
        assert stats.num_in_place_transfers == (2 if in_place else 0), stats
        per_block = stats.num_kv_skipped_bytes // held
        full_turn_1 = -(-len(first) // BLOCK_SIZE) * per_block
        assert stats.num_kv_transfer_bytes == full_turn_1 + (total - held) * per_block, stats

    flags = ["--prefill", "1", "--decode", "1", "--cluster-secret-file", str(secret),
             "--kv-transport", "tcp"]  # fmt: skip
    if not in_place:
        flags.append(_write_in_place_off_flag())
    assert serve(flags, check) == cold
