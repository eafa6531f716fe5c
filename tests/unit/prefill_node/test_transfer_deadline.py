"""A KV hand-off's deadline measures lack of progress: a prefill that keeps computing (its own
chunks, or the prompts queued ahead of it) outlives the no-progress timeout and hands off; a
prefill node that stops stepping fails it within that timeout, the prefill is aborted there
(and D falls back); the hand-off's own time excludes the queue; a receiver that ended before
its sender's handshake refuses it at once.

The prefill node's queue and pace are forced by wrapping its engine's step (held back by an
Event, or slowed by a sleep), not by timing luck."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest

from cache_transfer import TransferState
from pdserve.config import SecurityConfig
from pdserve.grpc_security import open_channel
from pdserve.security import load_cluster_auth
from pdserve.v1 import node_pb2, node_pb2_grpc
from tests.unit.decode_node.node_harness import (
    GREEDY,
    RPC_TIMEOUT_S,
    decode_request,
    engine_config,
    prompt,
    read_chunks,
    read_prefill,
    read_ticket,
    run,
    running_nodes,
    tokens_of,
    wait_until,
)

pytestmark = pytest.mark.timeout(120)

HOLD_S = 3.0  # how long the prefill node's engine is kept from starting the prefill


def hold_prefills(server) -> threading.Event:
    """Keep `server`'s engine from stepping (its requests wait in the scheduler's queue, its
    commands still run, as between the steps of a busy engine) until the returned event is
    set."""
    release = threading.Event()
    step = server.core.step

    def held_step():
        if release.wait(0.01):
            return step()
        return []

    server.core.step = held_step
    return release


def slow_steps(server, step_s: float) -> None:
    """Make every step of `server`'s engine take `step_s` more (a busy CPU): it still steps,
    so its per-layer hook, and the progress it reports, go on."""
    step = server.core.step

    def slow_step():
        time.sleep(step_s)
        return step()

    server.core.step = slow_step


def prefill_request(request_id, prompt_ids, ticket, **fields) -> node_pb2.PrefillRequest:
    return node_pb2.PrefillRequest(
        request_id=request_id, prompt_token_ids=prompt_ids, sampling=GREEDY, ticket=ticket,
        **fields,
    )  # fmt: skip


def test_queueing_on_the_prefill_node_is_not_transfer_time() -> None:
    prompt_ids = prompt(21, seed=3)

    async def main() -> None:
        async with running_nodes("tcp", transfer_timeout_s=30.0) as nodes:
            release = hold_prefills(nodes.prefill)
            decode = nodes.decode_stub.Decode(
                decode_request("q1", prompt_ids, transfer_timeout_s=30.0), timeout=RPC_TIMEOUT_S
            )
            ticket = await read_ticket(decode)
            prefill = nodes.prefill_stub.Prefill(
                prefill_request("q1", prompt_ids, ticket), timeout=RPC_TIMEOUT_S
            )
            receiver = nodes.decode.manager.get(ticket.transfer_id)
            await wait_until(lambda: receiver.state == TransferState.WAITING)  # handshook
            held_s = time.monotonic()
            await asyncio.sleep(HOLD_S)  # queued: the hand-off's own time has not started
            sender = nodes.prefill.manager.get(ticket.transfer_id)
            assert not sender.started and sender.state == TransferState.WAITING
            assert not receiver.started and receiver.state == TransferState.WAITING
            release.set()
            first, result = await read_prefill(prefill)
            chunks = await read_chunks(decode)
            queued_s = time.monotonic() - held_s
            assert result.transfer_result.ok, result
            # the hand-off's own time excludes the queue (it was held for HOLD_S of it)
            assert result.transfer_result.elapsed_s < min(HOLD_S, queued_s)
            assert tokens_of(chunks)[0] == first.first_token.token_id
            assert not nodes.decode.traces["q1"].prefilled_locally

    run(main())


def test_a_prefill_that_progresses_outlives_the_no_progress_timeout() -> None:
    """A long prompt computed in many slow chunks, and a second prompt queued behind it,
    each take several times the 1 s no-progress timeout: both hand off, none falls back, and
    the prefill node computes each prompt once."""
    long_ids, queued_ids = prompt(64, seed=8), prompt(24, seed=9)
    chunked = engine_config(prefill_only=True, max_num_batched_tokens=8)  # 8 chunks of 8

    async def main() -> None:
        async with running_nodes("tcp", prefill_engine=chunked, transfer_timeout_s=1.0) as nodes:
            slow_steps(nodes.prefill, 0.4)  # 8 steps of >= 0.4 s before the second starts
            decodes, prefills = [], []
            for request_id, ids in (("long", long_ids), ("behind", queued_ids)):
                decode = nodes.decode_stub.Decode(
                    decode_request(request_id, ids, transfer_timeout_s=1.0),
                    timeout=RPC_TIMEOUT_S,
                )
                ticket = await read_ticket(decode)
                request = prefill_request(request_id, ids, ticket, transfer_timeout_s=1.0)
                prefills.append(nodes.prefill_stub.Prefill(request, timeout=RPC_TIMEOUT_S))
                decodes.append(decode)
            results = await asyncio.gather(*(read_prefill(call) for call in prefills))
            for (first, result), decode in zip(results, decodes, strict=True):
                assert result.transfer_result.ok, result
                assert tokens_of(await read_chunks(decode))[0] == first.first_token.token_id
            for request_id in ("long", "behind"):
                assert not nodes.decode.traces[request_id].prefilled_locally
            prefill_stats, decode_stats = await nodes.stats()
            assert decode_stats.num_local_prefills == 0
            # each prompt computed once, on the prefill node
            assert prefill_stats.num_prefilled_tokens == len(long_ids) + len(queued_ids)
            assert decode_stats.num_prefilled_tokens == 0

    run(main())


@pytest.mark.parametrize("where", ["request", "node"])
def test_a_stalled_prefill_fails_within_the_no_progress_timeout_and_decode_falls_back(where):
    """The prefill node's engine stops stepping (nothing progresses): the hand-off fails after
    the no-progress timeout, which comes with the request (the router's) or is the node's own
    (the cap); the queued prefill is aborted and D prefills locally."""
    prompt_ids = prompt(17, seed=4)
    node_timeout_s, request_timeout_s = (30.0, 1.0) if where == "request" else (1.0, 30.0)

    async def main() -> None:
        async with running_nodes("tcp", transfer_timeout_s=node_timeout_s) as nodes:
            release = hold_prefills(nodes.prefill)
            decode = nodes.decode_stub.Decode(
                decode_request("q2", prompt_ids, transfer_timeout_s=30.0), timeout=RPC_TIMEOUT_S
            )
            ticket = await read_ticket(decode)
            request = prefill_request(
                "q2", prompt_ids, ticket, transfer_timeout_s=request_timeout_s
            )
            prefill = nodes.prefill_stub.Prefill(request, timeout=RPC_TIMEOUT_S)
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await asyncio.wait_for(prefill.read(), RPC_TIMEOUT_S)
            assert error.value.code() == grpc.StatusCode.ABORTED
            assert "no progress for 1s" in error.value.details()
            # P told D (its failed result): D prefills locally long before its own 30 s bound
            chunks = await read_chunks(decode)
            assert len(tokens_of(chunks)) == GREEDY.max_tokens
            assert nodes.decode.traces["q2"].prefilled_locally
            release.set()  # the aborted prefill never runs; every block is free (harness)

    run(main())


@pytest.mark.parametrize("secret", [False, True], ids=["open", "cluster-secret"])
def test_a_handshake_after_the_receiver_ended_is_refused_at_once(tmp_path, secret) -> None:
    """With a cluster secret the refusal goes only to a sender that proves it (this one)."""
    prompt_ids = prompt(13, seed=6)
    security = SecurityConfig()
    if secret:
        (tmp_path / "secret").write_text("a-cluster-secret-0123456789abcdef\n")
        security = SecurityConfig(cluster_secret_file=str(tmp_path / "secret"))

    async def main() -> None:
        async with running_nodes(
            "tcp", transfer_timeout_s=30.0, security=security, check_free=not secret
        ) as nodes:
            if secret:
                authenticate(nodes, security)
            decode = nodes.decode_stub.Decode(
                decode_request("q3", prompt_ids, transfer_timeout_s=30.0), timeout=RPC_TIMEOUT_S
            )
            ticket = await read_ticket(decode)
            cancel = node_pb2.CancelTransferRequest(transfer_id=ticket.transfer_id, reason="test")
            assert (await nodes.decode_stub.CancelTransfer(cancel, timeout=RPC_TIMEOUT_S)).found
            await read_chunks(decode)  # D prefilled locally
            started_s = time.monotonic()
            prefill = nodes.prefill_stub.Prefill(  # P handshakes with a receiver that is gone
                prefill_request("q3", prompt_ids, ticket), timeout=RPC_TIMEOUT_S
            )
            failure = await prefill_failure(prefill)
            assert time.monotonic() - started_s < 10.0  # not its 30 s transfer timeout
            assert "receiver already ended" in failure
            for server in (nodes.prefill, nodes.decode):
                await wait_until(lambda s=server: s.manager.num_pending == 0)

    run(main())


def authenticate(nodes, security: SecurityConfig) -> None:
    """The test's stubs prove the cluster secret."""
    auth = load_cluster_auth(security)
    channels = [open_channel(n.address, security, auth) for n in (nodes.prefill, nodes.decode)]
    nodes.channels.extend(channels)
    nodes.prefill_stub = node_pb2_grpc.PrefillNodeStub(channels[0])
    nodes.decode_stub = node_pb2_grpc.DecodeNodeStub(channels[1])


async def prefill_failure(call) -> str:
    """Why a Prefill call's hand-off failed: the call's status (the prefill was aborted
    before its first token) or its failed transfer result."""
    try:
        while True:
            message = await asyncio.wait_for(call.read(), RPC_TIMEOUT_S)
            assert message is not grpc.aio.EOF, "the hand-off did not fail"
            if message.WhichOneof("kind") == "transfer_result":
                assert not message.transfer_result.ok
                return message.transfer_result.error
    except grpc.aio.AioRpcError as error:
        assert error.code() == grpc.StatusCode.ABORTED, error
        return error.details()


def test_a_negative_transfer_timeout_is_invalid() -> None:
    async def main() -> None:
        async with running_nodes("local") as nodes:
            ticket = node_pb2.TransferTicket(
                transfer_id="t", dst_address="local://x", num_tokens=3, dst_block_ids=[0],
                layout_hash=nodes.prefill.layout.layout_hash(),
            )  # fmt: skip
            request = prefill_request("neg", [5, 6, 7], ticket, transfer_timeout_s=-1.0)
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await nodes.prefill_stub.Prefill(request, timeout=RPC_TIMEOUT_S).read()
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "transfer_timeout_s" in error.value.details()

    run(main())
