"""TTFT does not wait for the decode node: the client's first chunk is the first token alone
(the prefill node's, through the router), the KV was handed off (no local prefill), and how long
before the decode node's second token it came is printed (a latency: timed by pd-bench, not here;
a loaded machine delays either side).

Prefill node, decode node and router run in this process (real gRPC servers and the tcp KV
transport on loopback) so the decode node's per-token timestamps can be compared with the
client's receive times on one clock."""

from __future__ import annotations

import time

import pytest

from pdserve.config import RouterConfig
from router.client import GenerationClient
from router.server import RouterServer
from tests.unit.decode_node.node_harness import engine_config, run, running_nodes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MODEL = "smollm2-135m"
PROMPTS = ["The capital of France is", "def quicksort(items):", "A short poem about rain:"]


def test_client_gets_first_token_before_decode_produces_second() -> None:
    async def main() -> list[tuple[float, float, int]]:
        async with running_nodes(
            "tcp",
            prefill_engine=engine_config(prefill_only=True, model=MODEL, num_blocks=256),
            decode_engine=engine_config(prefill_only=False, model=MODEL, num_blocks=256),
        ) as nodes:
            router = RouterServer(
                RouterConfig(
                    host="127.0.0.1",
                    port=0,
                    http_port=0,
                    prefill_addrs=(nodes.prefill.address,),
                    decode_addrs=(nodes.decode.address,),
                )
            )
            await router.start()
            timings = []
            try:
                async with GenerationClient(router.address) as client:
                    for prompt in PROMPTS:
                        first_at, first_len, request_id = None, 0, ""
                        async for chunk in client.generate(
                            prompt, temperature=0.0, max_tokens=8, ignore_eos=True, timeout_s=60
                        ):
                            if first_at is None:
                                first_at, first_len = time.monotonic(), len(chunk.token_ids)
                                request_id = chunk.request_id
                        trace = nodes.decode.traces[request_id]
                        assert not trace.prefilled_locally
                        timings.append((first_at, trace.token_times_s[1], first_len))
            finally:
                await router.stop()
            return timings

    for first_at, second_produced_at, first_len in run(main(), timeout_s=240):
        print(
            f"token 0 at the client {1e3 * (second_produced_at - first_at):.1f} ms before "
            "the decode node produced token 1"
        )
        # token 0 comes alone, from the prefill node's path (how long before the decode node's
        # token 1 is a latency, printed above: a loaded machine delays either side, and
        # pd-bench ttft --breakdown measures it)
        assert first_len == 1, "the first chunk should carry the first token alone"
