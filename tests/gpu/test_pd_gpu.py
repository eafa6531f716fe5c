"""Disaggregated serving on one GPU, two processes (issue 9's acceptance): a real 1P1D
`pd-serve --device cuda` (prefill and decode node sharing the GPU) over each KV transport gives
exactly the greedy tokens of colocated serving on the same GPU and of the offline engine, with
the very same logprobs as colocated serving (a KV hand-off off by one bit would move them), for
float32 and bfloat16. Requests go one at a time, so every run computes the same shapes.

    PYTHONPATH=$PWD python -m pytest tests/gpu/test_pd_gpu.py -q -p no:cacheprovider -o addopts=""
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from cache_transfer.transports import ucx_available
from pdserve.v1 import node_pb2, node_pb2_grpc
from router.client import GenerationClient, GenerationResult
from tests.e2e.cluster import Cluster

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available"),
    pytest.mark.timeout(900),
]

MODEL = "synthetic:smollm2-135m:layers=8"  # vocab 49152: no tokenizer, token-id prompts
NUM_PROMPTS = 4
MAX_TOKENS = 12
NUM_KV_BLOCKS = 2048  # per node: both nodes share the one GPU
OFFLINE_KV_BYTES = 1 << 30
REQUEST_TIMEOUT_S = 120.0
RPC_TIMEOUT_S = 10.0

TRANSPORTS = [
    pytest.param(
        "ucx",
        marks=pytest.mark.skipif(
            not ucx_available(), reason="ucxx does not import here (install ucxx-cu12 / -cu13)"
        ),
    ),
    "tcp",
]


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(9)
    lengths = torch.randint(5, 400, (NUM_PROMPTS,), generator=gen).tolist()
    return [torch.randint(100, 49152, (n,), generator=gen).tolist() for n in lengths]


def serve_flags(dtype: str, *extra: str) -> list[str]:
    return ["--model", MODEL, "--device", "cuda", "--dtype", dtype, "--num-kv-blocks",
            str(NUM_KV_BLOCKS), "--log-level", "warning", *extra]  # fmt: skip


def greedy(addr: str) -> list[GenerationResult]:
    """Each prompt alone (one after the other), greedy, with the sampled tokens' logprobs."""

    async def main() -> list[GenerationResult]:
        async with GenerationClient(addr) as client:
            return [
                await client.generate_all(
                    prompt_token_ids=ids,
                    max_tokens=MAX_TOKENS,
                    temperature=0.0,
                    ignore_eos=True,
                    logprobs=0,
                    timeout_s=REQUEST_TIMEOUT_S,
                )
                for ids in prompts()
            ]

    return asyncio.run(main())


def logprobs_of(results: list[GenerationResult]) -> list[list[float]]:
    return [[lp.logprob for lp in r.logprobs] for r in results]


def run_cluster(flags: list[str], check=None) -> list[GenerationResult]:
    """Start pd-serve with `flags`, serve the prompts, `check(cluster)`, stop it (nothing may
    outlive it)."""
    cluster = Cluster(flags).start()
    try:
        results = greedy(cluster.router)
        if check is not None:
            check(cluster)
    finally:
        leftover = cluster.stop()
    assert not leftover, f"processes left behind after stopping pd-serve: {leftover}"
    return results


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def dtype(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def offline(dtype: str) -> list[list[int]]:
    from engine import LLM, SamplingParams

    llm = LLM(MODEL, device="cuda", dtype=dtype, kv_cache_memory=OFFLINE_KV_BYTES)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    tokens = [llm.generate([ids], params)[0].token_ids for ids in prompts()]
    llm.engine.check_no_leaks()
    del llm
    torch.cuda.empty_cache()
    return tokens


@pytest.fixture(scope="module")
def colocated(dtype: str) -> list[GenerationResult]:
    return run_cluster(serve_flags(dtype, "--prefill", "0", "--decode", "1"))


def _check_handoffs(transport: str):
    def check(cluster: Cluster) -> None:
        for name in ("prefill-0", "decode-0"):
            with grpc.insecure_channel(cluster.nodes[name]) as channel:
                info = node_pb2_grpc.NodeStub(channel).GetNodeInfo(
                    node_pb2.GetNodeInfoRequest(), timeout=RPC_TIMEOUT_S
                )
            assert info.kv_transport == transport, (name, info.kv_transport)
        decode = cluster.node_stats("decode-0")
        assert decode.num_local_prefills == 0 and decode.num_failed_transfers == 0, decode
        # both nodes on the one GPU: every hand-off written in place by the prefill node
        assert decode.num_in_place_transfers == NUM_PROMPTS, decode
        assert cluster.node_stats("prefill-0").num_finished_requests == NUM_PROMPTS
        assert len(decode.last_transfer.landed_s) == 8  # every layer of the last request landed
        assert all(t > 0 for t in decode.last_transfer.landed_s)
        stats = cluster.wait_all_blocks_free(timeout_s=10)
        assert all(s.num_free_kv_blocks == s.num_kv_blocks for s in stats.values()), stats

    return check


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_1p1d_on_one_gpu_equals_colocated_and_offline(
    dtype: str, transport: str, colocated: list[GenerationResult], offline: list[list[int]]
) -> None:
    flags = serve_flags(dtype, "--prefill", "1", "--decode", "1", "--kv-transport", transport)
    disaggregated = run_cluster(flags, _check_handoffs(transport))
    assert [r.token_ids for r in disaggregated] == [r.token_ids for r in colocated] == offline
    assert all(len(r.token_ids) == MAX_TOKENS for r in disaggregated)
    # the prefill's first token and every decode step computed on the moved KV: bit for bit
    assert logprobs_of(disaggregated) == logprobs_of(colocated)
