"""The prefill's forward never waits for the KV hand-off: with every layer's send held back on
purpose (a transport whose payload sends block until the test opens a gate), the prefill still
computes every layer and streams its first token; the layers go out only once the gate opens,
and the hand-off then completes."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.v1 import node_pb2
from tests.unit.decode_node.node_harness import (
    GREEDY,
    RPC_TIMEOUT_S,
    decode_request,
    prompt,
    read_ticket,
    run,
    running_nodes,
)

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("transport", ["tcp", "local"])
def test_slow_sends_do_not_stall_the_forward(transport: str) -> None:
    prompt_ids = prompt(37, seed=5)

    async def main() -> None:
        async with running_nodes(transport) as nodes:
            gate = asyncio.Event()
            sends_started = hold_layer_sends(nodes.prefill.manager._transport, gate)
            decode_call = nodes.decode_stub.Decode(
                decode_request("p", prompt_ids), timeout=RPC_TIMEOUT_S
            )
            ticket = await read_ticket(decode_call)
            request = node_pb2.PrefillRequest(
                request_id="p", prompt_token_ids=prompt_ids, sampling=GREEDY, ticket=ticket
            )
            call = nodes.prefill_stub.Prefill(request, timeout=RPC_TIMEOUT_S)
            first = await asyncio.wait_for(call.read(), RPC_TIMEOUT_S)
            assert first.WhichOneof("kind") == "first_token"  # the forward is done
            (trace,) = nodes.prefill.traces.values()
            num_layers = nodes.prefill.layout.num_layers
            assert all(t is not None for t in trace.layer_computed_s)  # every layer computed
            assert trace.layer_sent_s == [None] * num_layers  # while no layer has gone out
            assert not gate.is_set()
            gate.set()
            result = await asyncio.wait_for(call.read(), RPC_TIMEOUT_S)
            assert result.transfer_result.ok, result.transfer_result.error
            assert sum(sends_started) == num_layers
            assert all(t is not None for t in trace.layer_sent_s)
            # the timeline pd-bench ttft prints: computed <= sent (P), landed (D), via GetStats
            prefill_stats, decode_stats = await nodes.stats()
            p_line, d_line = prefill_stats.last_transfer, decode_stats.last_transfer
            assert p_line.transfer_id == d_line.transfer_id == ticket.transfer_id
            assert len(p_line.computed_s) == len(d_line.landed_s) == num_layers
            assert all(0 < c <= s for c, s in zip(p_line.computed_s, p_line.sent_s))
            assert all(t > 0 for t in d_line.landed_s)
            decode_call.cancel()

    run(main())


def hold_layer_sends(kv_transport, gate: asyncio.Event) -> list[int]:
    """Make `kv_transport` a slow wire: layers' KV (one or several messages per send) held
    until `gate` opens, every message in the order its send began (as a transport keeps it).
    The number of layers each held send carried, appended as it begins."""
    real_send_many = kv_transport.send_many  # every send goes through it
    previous: list[asyncio.Future | None] = [None]  # the last send's hand-off
    started: list[int] = []

    async def slow_send_many(peer_address, messages):
        before, mine = previous[0], asyncio.get_running_loop().create_future()
        previous[0] = mine
        try:
            if num_layers := sum(payload is not None for _, payload in messages):
                started.append(num_layers)
                await gate.wait()
            if before is not None:
                await before
            sending = real_send_many(peer_address, messages)
            mine.set_result(None)  # the next send begins behind this one
            await sending
        finally:
            if not mine.done():
                mine.set_result(None)

    kv_transport.send_many = slow_send_many
    return started
