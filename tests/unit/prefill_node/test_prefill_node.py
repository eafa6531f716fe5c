"""The Prefill RPC: two messages, ticket and parameter checks, and a clean end however the
hand-off goes (refused, timed out, cancelled by the router, aborted): nothing stays held."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from engine import LLM, SamplingParams
from pdserve.v1 import node_pb2, transfer_pb2
from tests.unit.decode_node.node_harness import (
    BLOCK_SIZE,
    GREEDY,
    MODEL,
    NUM_BLOCKS,
    RPC_TIMEOUT_S,
    Nodes,
    RawPeer,
    decode_request,
    engine_config,
    prompt,
    read_prefill,
    read_ticket,
    run,
    running_nodes,
    wait_until,
)

pytestmark = pytest.mark.timeout(120)


def fake_ticket(nodes: Nodes, peer: RawPeer, num_tokens: int) -> node_pb2.TransferTicket:
    """A ticket pointing the prefill node at `peer` instead of a decode node."""
    return node_pb2.TransferTicket(
        transfer_id="t-raw",
        dst_address=peer.address,
        dst_block_ids=list(range(nodes.prefill.layout.num_blocks_for(num_tokens + 1))),
        layout_hash=nodes.prefill.layout.layout_hash(),
        num_tokens=num_tokens,
    )


def prefill(
    nodes: Nodes,
    prompt_ids: list[int],
    ticket: node_pb2.TransferTicket,
    sampling: node_pb2.NodeSamplingParams = GREEDY,
    request_id: str = "p",
) -> grpc.aio.UnaryStreamCall:
    request = node_pb2.PrefillRequest(
        request_id=request_id, prompt_token_ids=prompt_ids, sampling=sampling, ticket=ticket
    )
    return nodes.prefill_stub.Prefill(request, timeout=RPC_TIMEOUT_S)


def test_prefill_streams_first_token_then_transfer_result() -> None:
    prompt_ids = prompt(26, seed=1)
    llm = LLM(MODEL, device="cpu", dtype="float32", block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)
    (expected,) = llm.generate([prompt_ids], SamplingParams(max_tokens=1, temperature=0.0))

    async def main() -> None:
        async with running_nodes("tcp") as nodes:
            call = nodes.decode_stub.Decode(decode_request("p", prompt_ids), timeout=RPC_TIMEOUT_S)
            ticket = await read_ticket(call)
            first, result = await read_prefill(prefill(nodes, prompt_ids, ticket))
            assert first.first_token.token_id == expected.token_ids[0]
            assert first.first_token.finish_reason == ""
            assert not first.first_token.HasField("logprob")  # not requested
            assert result.transfer_result.ok
            assert result.transfer_result.elapsed_s > 0
            call.cancel()  # the decode stream is not the point here

    run(main())


def test_layout_mismatch_is_failed_precondition() -> None:
    """A bfloat16 prefill node cannot fill a float32 decode node's blocks."""
    prompt_ids = prompt(9, seed=2)
    bf16 = engine_config(prefill_only=True, dtype="bfloat16")

    async def main() -> None:
        async with running_nodes("local", prefill_engine=bf16) as nodes:
            assert nodes.prefill.layout.layout_hash() != nodes.decode.layout.layout_hash()
            call = nodes.decode_stub.Decode(
                decode_request("m", prompt_ids, transfer_timeout_s=60.0), timeout=RPC_TIMEOUT_S
            )
            ticket = await read_ticket(call)
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await asyncio.wait_for(prefill(nodes, prompt_ids, ticket).read(), RPC_TIMEOUT_S)
            assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "layout hash" in error.value.details()
            call.cancel()

    run(main())


def bad_prefill_requests(ticket: node_pb2.TransferTicket) -> dict[str, node_pb2.PrefillRequest]:
    prompt_ids = list(range(5, 5 + ticket.num_tokens))

    def request(**overrides: object) -> node_pb2.PrefillRequest:
        fields = dict(request_id="b", prompt_token_ids=prompt_ids, sampling=GREEDY, ticket=ticket)
        fields.update(overrides)
        return node_pb2.PrefillRequest(**fields)

    no_address = node_pb2.TransferTicket()
    no_address.CopyFrom(ticket)
    no_address.ClearField("dst_address")
    few_blocks = node_pb2.TransferTicket()
    few_blocks.CopyFrom(ticket)
    del few_blocks.dst_block_ids[1:]
    return {
        "negative-temperature": request(sampling=node_pb2.NodeSamplingParams(temperature=-0.5)),
        "min-tokens-above-max": request(
            sampling=node_pb2.NodeSamplingParams(max_tokens=2, min_tokens=3)
        ),
        "token-outside-vocab": request(prompt_token_ids=[*prompt_ids[:-1], 100000]),
        "prompt-differs-from-ticket": request(prompt_token_ids=prompt_ids[:-1]),
        "no-dst-address": request(ticket=no_address),
        "too-few-blocks": request(ticket=few_blocks),
        "no-request-id": request(request_id=""),
    }


@pytest.mark.parametrize("name", list(bad_prefill_requests(node_pb2.TransferTicket())))
def test_bad_prefill_request_is_invalid_argument(name: str) -> None:
    async def main() -> None:
        async with running_nodes("local") as nodes:
            peer = RawPeer.start("local")
            try:
                ticket = fake_ticket(nodes, peer, num_tokens=10)
                request = bad_prefill_requests(ticket)[name]
                call = nodes.prefill_stub.Prefill(request, timeout=RPC_TIMEOUT_S)
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    await asyncio.wait_for(call.read(), RPC_TIMEOUT_S)
                assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert error.value.details()
                assert peer.received == []  # refused before any handshake
            finally:
                await peer.close()

    run(main())


@pytest.mark.parametrize("ending", ["router-cancels", "abort-rpc"])
def test_end_during_transfer_frees_blocks_and_tells_the_receiver(ending: str) -> None:
    """The receiver never acks the handshake: the first token still streams at once; then the
    router cancels the call (or aborts the request): P's blocks are free within 1 s, its
    sender is gone, and the receiver is told the transfer failed."""
    prompt_ids = prompt(21, seed=3)

    async def main() -> None:
        async with running_nodes("tcp") as nodes:
            peer = RawPeer.start("tcp")
            try:
                call = prefill(nodes, prompt_ids, fake_ticket(nodes, peer, len(prompt_ids)))
                first = await asyncio.wait_for(call.read(), RPC_TIMEOUT_S)
                assert first.WhichOneof("kind") == "first_token"
                await wait_until(lambda: peer.kinds() == ["handshake"])
                prefill_stats, _ = await nodes.stats()
                assert prefill_stats.num_free_kv_blocks < prefill_stats.num_kv_blocks  # held
                assert prefill_stats.num_pending_transfers == 1
                if ending == "router-cancels":
                    call.cancel()
                else:
                    abort = node_pb2.AbortRequest(request_id="p")
                    response = await nodes.prefill_node_stub.Abort(abort, timeout=RPC_TIMEOUT_S)
                    assert response.found
                    result = await asyncio.wait_for(call.read(), RPC_TIMEOUT_S)
                    assert not result.transfer_result.ok
                await wait_until(lambda: peer.kinds()[-1:] == ["result"])
                assert not peer.received[-1].result.ok
            finally:
                await peer.close()

    run(main())


@pytest.mark.parametrize("receiver", ["refuses", "never-answers"])
def test_failed_hand_off_is_reported_not_raised(receiver: str) -> None:
    """A refused handshake, or a receiver silent past the prefill node's transfer timeout:
    the Prefill stream still ends normally, with transfer_result.ok false and the reason. (The
    handshake goes out once the ticket is in, so a refusal may also come before the first
    token: then the prefill is aborted, and the call ends ABORTED with the reason.)"""
    prompt_ids = prompt(10, seed=4)

    async def main() -> None:
        async with running_nodes("local", transfer_timeout_s=0.3) as nodes:
            peer = RawPeer.start("local")
            try:
                ticket = fake_ticket(nodes, peer, len(prompt_ids))
                call = prefill(nodes, prompt_ids, ticket)
                if receiver == "refuses":
                    await wait_until(lambda: peer.kinds() == ["handshake"])
                    ack = transfer_pb2.HandshakeAck(
                        accepted=False, reason="no room", protocol_version=1
                    )
                    await peer.send(
                        peer.received[0].handshake.src_address,
                        ticket.transfer_id,
                        handshake_ack=ack,
                    )
                expected = "no room" if receiver == "refuses" else "timed out"
                try:
                    _, result = await read_prefill(call)
                except grpc.aio.AioRpcError as error:  # refused before the prefill was done
                    assert receiver == "refuses"
                    assert error.code() == grpc.StatusCode.ABORTED
                    assert expected in error.details()
                else:
                    assert not result.transfer_result.ok
                    assert expected in result.transfer_result.error
                prefill_stats, _ = await nodes.stats()
                assert prefill_stats.num_failed_transfers == 1
            finally:
                await peer.close()

    run(main())


def test_roles_need_the_right_engine_mode() -> None:
    from decode_node.decode_server import DecodeServer
    from engine.engine_core import EngineCore
    from pdserve.config import NodeConfig
    from prefill_node.prefill_server import PrefillServer

    async def main() -> None:
        config = NodeConfig(kv_transport="local")
        with pytest.raises(ValueError, match="prefill_only=True"):
            PrefillServer(EngineCore(engine_config(prefill_only=False)), config)
        with pytest.raises(ValueError, match="without"):
            DecodeServer(EngineCore(engine_config(prefill_only=True)), config)

    run(main())
