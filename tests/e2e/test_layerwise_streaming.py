"""Layer-wise KV streaming overlaps the prefill's compute.

A prefill node and a decode node run in this process on loopback with the tcp transport, on a
model whose layers take measurable time on CPU (12 SmolLM2-135M layers, fp32, a 1000-token
prompt: tens of milliseconds per layer). The nodes' instrumentation must show layer i of the
request sent by P and landed at D before P computed layer i + 1, for a clear majority of
layers, and layer 0 landed before the last layer was computed. The tokens equal those of local
prefill on the decode node.

The prefill of 1000 tokens takes ~3 s on an idle 2-core machine and several times that on a
busy one, so the requests, the transfer and the pools' return get deadlines that bound a hang
(STREAM_TIMEOUT_S), not ones that time the work (the harness's 10 s RPC deadline covered the
whole prefill and decode of a request, and expired under load).
"""

from __future__ import annotations

import pytest

from tests.unit.decode_node.node_harness import (
    engine_config,
    prompt,
    run,
    run_disaggregated,
    run_local,
    running_nodes,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MODEL = "synthetic:smollm2-135m:layers=12"
NUM_LAYERS = 12
PROMPT_LEN = 1000
NUM_BLOCKS = 300  # of 4 tokens: the prompt takes 250
STREAM_TIMEOUT_S = 120.0  # each request, its KV transfer, and the pools' return afterwards


def test_layers_are_sent_while_later_layers_compute() -> None:
    prompt_ids = prompt(PROMPT_LEN, seed=42)

    async def main() -> None:
        async with running_nodes(
            "tcp",
            prefill_engine=engine_config(prefill_only=True, model=MODEL, num_blocks=NUM_BLOCKS),
            decode_engine=engine_config(prefill_only=False, model=MODEL, num_blocks=NUM_BLOCKS),
            transfer_timeout_s=STREAM_TIMEOUT_S,
            check_free=False,  # checked below, with a deadline a busy machine meets
        ) as nodes:
            handoff = await run_disaggregated(nodes, "long", prompt_ids, timeout_s=STREAM_TIMEOUT_S)
            assert handoff.transfer_result.ok
            local = await run_local(nodes, "long-local", prompt_ids, timeout_s=STREAM_TIMEOUT_S)
            assert handoff.token_ids == local

            sent = nodes.prefill.traces[handoff.ticket.transfer_id]
            arrived = nodes.decode.traces["long"].layer_arrived_s
            computed_s = sent.layer_computed_s
            assert sorted(arrived) == list(range(NUM_LAYERS))
            assert None not in computed_s and None not in sent.layer_sent_s
            t0 = computed_s[0]
            print("\nlayer  computed_ms  sent_ms  arrived_ms")
            for i in range(NUM_LAYERS):
                print(
                    f"{i:5d}  {1e3 * (computed_s[i] - t0):11.1f}  "
                    f"{1e3 * (sent.layer_sent_s[i] - t0):7.1f}  {1e3 * (arrived[i] - t0):10.1f}"
                )
            overlapped = [
                i
                for i in range(NUM_LAYERS - 1)
                if sent.layer_sent_s[i] < computed_s[i + 1] and arrived[i] < computed_s[i + 1]
            ]
            assert len(overlapped) >= 0.75 * (NUM_LAYERS - 1), overlapped
            assert arrived[0] < computed_s[NUM_LAYERS - 1]
            await nodes.assert_all_free(within_s=STREAM_TIMEOUT_S)

    run(main(), timeout_s=4 * STREAM_TIMEOUT_S)
