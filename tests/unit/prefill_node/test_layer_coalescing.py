"""Fewer, larger messages: layers that are all packed by the time the prefill node's sender
runs go to the decode node as one transport message, and the decode node still lands and
reports every layer; the hand-off stays byte-exact (greedy tokens equal local prefill's)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from cache_transfer.transports import ucx_available
from engine.testing import hold_engine_thread, num_queued_commands
from tests.unit.decode_node import node_harness as harness

pytestmark = pytest.mark.timeout(120)

HOLD_S = 30.0  # the longest the test holds the event loop while the forward runs


TRANSPORTS = [
    "tcp",
    "local",
    pytest.param(
        "ucx", marks=pytest.mark.skipif(not ucx_available(), reason="ucxx does not import here")
    ),
]


def count_layer_messages(kv_transport) -> list[int]:
    """From now on, the number of layers (payloads) in each message `kv_transport` sends."""
    batches: list[int] = []
    real_send_many = kv_transport.send_many

    async def counting_send_many(peer_address, messages):
        if num := sum(payload is not None for _, payload in messages):
            batches.append(num)
        await real_send_many(peer_address, messages)

    kv_transport.send_many = counting_send_many
    return batches


def record_messages_with_layers(kv_transport, computed: list[int]) -> list[tuple[int, int]]:
    """From now on, for each message `kv_transport` sends with a layer payload: (its messages,
    how many layers were computed by then)."""
    batches: list[tuple[int, int]] = []
    real_send_many = kv_transport.send_many

    async def recording_send_many(peer_address, messages):
        if any(payload is not None for _, payload in messages):
            batches.append((len(messages), len(computed)))
        await real_send_many(peer_address, messages)

    kv_transport.send_many = recording_send_many
    return batches


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_layers_packed_before_the_sender_runs_go_as_one_message(transport: str) -> None:
    prompt_ids = harness.prompt(41, seed=7)

    async def main() -> None:
        async with harness.running_nodes(transport) as nodes:
            loop = asyncio.get_running_loop()
            streamer = nodes.prefill.streamer
            num_layers = nodes.prefill.layout.num_layers
            last_layer_done = threading.Event()
            real_hook = streamer.on_layer_done

            def hook(layer_idx, chunks):  # engine thread
                if layer_idx == 0:  # hold the event loop until every layer is queued
                    loop.call_soon_threadsafe(last_layer_done.wait, HOLD_S)
                real_hook(layer_idx, chunks)
                if layer_idx == num_layers - 1:
                    last_layer_done.set()

            nodes.prefill.core.on_layer_done = hook
            batches = count_layer_messages(nodes.prefill.manager._transport)
            handoff = await harness.run_disaggregated(nodes, "pd", prompt_ids)
            assert handoff.transfer_result.ok, handoff.transfer_result.error
            assert batches == [num_layers]  # every layer in one message
            local = await harness.run_local(nodes, "local", prompt_ids)
            assert handoff.token_ids == local  # the KV arrived byte-exact
            _, decode_stats = await nodes.stats()
            landed = decode_stats.last_transfer
            assert landed.transfer_id == handoff.ticket.transfer_id
            assert len(landed.landed_s) == num_layers and all(t > 0 for t in landed.landed_s)
            (trace,) = nodes.prefill.traces.values()
            assert all(t is not None for t in trace.layer_sent_s)

    harness.run(main())


@pytest.mark.parametrize("asks_in_place", [False, True], ids=["sends", "asks-in-place"])
@pytest.mark.parametrize("transport", ["tcp", "local"])
def test_a_receiver_on_the_same_gpu_gets_the_layers_held_back_then_the_last_alone(
    transport: str, asks_in_place: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prefill node whose ticket names its own GPU (the two processes would time-slice it)
    sends nothing until the layer before the last is computed, then all layers so far as one
    message, then the last alone; a receiver on another GPU gets layer 0 while later layers
    compute. So does a sender that asks to write in place (not granted here: payloads go).
    (CPU: device names set by hand; the engine thread lets the event loop run after layer 0,
    and after the layer before the last until a message went.)"""
    import cache_transfer.receiver
    from cache_transfer.sender import KVSender

    prompt_ids = harness.prompt(41, seed=8)
    monkeypatch.setattr(cache_transfer.receiver, "kv_device_id", lambda device: "GPU-shared")
    if asks_in_place:
        monkeypatch.setattr(KVSender, "may_write_in_place", property(lambda self: True))

    async def main() -> None:
        async with harness.running_nodes(transport) as nodes:
            loop = asyncio.get_running_loop()
            streamer = nodes.prefill.streamer
            num_layers = nodes.prefill.layout.num_layers
            real_hook = streamer.on_layer_done
            computed: list[int] = []  # layers whose hook ran
            batches = record_messages_with_layers(nodes.prefill.manager._transport, computed)

            def hook(layer_idx, chunks):  # engine thread
                computed.append(layer_idx)
                real_hook(layer_idx, chunks)
                if layer_idx == 0:  # the loop runs what layer 0 queued (FIFO), then we go on
                    asyncio.run_coroutine_threadsafe(asyncio.sleep(0.05), loop).result(HOLD_S)
                if layer_idx == num_layers - 2 and streamer._kv_device == "GPU-shared":
                    went = harness.wait_until(lambda: batches, HOLD_S)  # the layers held back
                    asyncio.run_coroutine_threadsafe(went, loop).result(HOLD_S)

            nodes.prefill.core.on_layer_done = hook
            streamer._kv_device = "GPU-shared"
            handoff = await harness.run_disaggregated(nodes, "pd", prompt_ids)
            assert handoff.transfer_result.ok, handoff.transfer_result.error
            assert batches == [(num_layers - 1, num_layers - 1), (1, num_layers)]  # then the last
            local = await harness.run_local(nodes, "local", prompt_ids)
            assert handoff.token_ids == local  # the KV arrived byte-exact

            streamer._kv_device = "GPU-other"
            del batches[:], computed[:]
            again = await harness.run_disaggregated(nodes, "pd2", prompt_ids)
            assert again.transfer_result.ok and again.token_ids == local
            assert batches[0] == (1, 1)  # layer 0 went while layer 1 was still to compute

    harness.run(main())


def hold_the_batch(nodes, step_sizes: list[int]) -> None:
    """Install a prefill hook that records each step's batch size and, after layer 0, waits
    until every sender is acknowledged, then holds the event loop until the last layer."""
    from cache_transfer import TransferState

    loop = asyncio.get_running_loop()
    streamer = nodes.prefill.streamer
    num_layers = nodes.prefill.layout.num_layers
    last_layer_done = threading.Event()
    real_hook = streamer.on_layer_done

    def acked() -> bool:
        senders = [o.sender for o in streamer._outgoing.values()]
        return all(s is not None and s.state >= TransferState.WAITING for s in senders)

    def hook(layer_idx, chunks):  # engine thread
        real_hook(layer_idx, chunks)
        if layer_idx == 0:
            step_sizes.append(len(chunks))
            waiting = harness.wait_until(acked, HOLD_S)
            asyncio.run_coroutine_threadsafe(waiting, loop).result(HOLD_S)
            loop.call_soon_threadsafe(last_layer_done.wait, HOLD_S)  # hold the loop
        if layer_idx == num_layers - 1:
            last_layer_done.set()

    nodes.prefill.core.on_layer_done = hook


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_batchs_layers_to_one_decode_node_go_as_one_message(transport: str) -> None:
    """Requests prefilled in one step, all to one decode node: the layers that are packed by
    the time their senders run go out as one transport message for the whole batch (the
    transfers' own sends join in `CoalescingTransport`), and every hand-off stays byte-exact.
    (The engine thread is held until all requests are queued, so they share a step; layer 0
    goes while the handshakes are answered; the loop is then held until the last layer.)"""
    num_requests = 4
    prompts = [harness.prompt(21 + 6 * i, seed=20 + i) for i in range(num_requests)]

    async def main() -> None:
        async with harness.running_nodes(transport) as nodes:
            engine = nodes.prefill.engine
            num_layers = nodes.prefill.layout.num_layers
            step_sizes: list[int] = []
            hold_the_batch(nodes, step_sizes)
            # layers in each message the wire carried (below the coalescing)
            batches = count_layer_messages(nodes.prefill.manager._transport.inner)
            release = await hold_engine_thread(engine, HOLD_S)
            handoffs = asyncio.gather(
                *(harness.run_disaggregated(nodes, f"r{i}", p) for i, p in enumerate(prompts))
            )
            await harness.wait_until(lambda: num_queued_commands(engine) >= num_requests, HOLD_S)
            release.set()
            results = await handoffs
            assert step_sizes == [num_requests]  # one prefill step
            assert all(r.transfer_result.ok for r in results), [r.transfer_result for r in results]
            assert sum(batches) == num_requests * num_layers
            assert batches[-1] == num_requests * (num_layers - 1)  # the batch's, after layer 0
            for i, (handoff, prompt_ids) in enumerate(zip(results, prompts, strict=True)):
                assert handoff.token_ids == await harness.run_local(nodes, f"l{i}", prompt_ids)

    harness.run(main())
