"""Forged and malformed input from anyone who can reach a port (an open cluster: no secret):
KV frames to a decode node's tcp KV port (garbage, for no transfer, oversized), forged tickets
to the prefill node, a forged registry record, malformed requests. Nothing crashes, nothing
leaks, nothing allocates the frame's size, every caller gets a clear status, and the cluster
serves on with the same tokens as before."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid

import grpc
import numpy as np
import pytest
import zmq

from cache_transfer import protocol
from pdserve.registry import NODE_KEY_PATTERN, NodeRecord
from pdserve.v1 import node_pb2, node_pb2_grpc, transfer_pb2
from tests.e2e.faults.fault_cluster import TRANSFER_TIMEOUT_S
from tests.e2e.faults.fault_tools import Outcome, burst, prompts, run_one, wait_registered
from tests.ports import unlistened_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

DEADLINE_S = 40.0
ALL = ["prefill-0", "decode-0", "decode-1"]
OVERSIZED_BYTES = 256 << 20
MAX_FRAME_RSS_GROWTH_MIB = 64.0
REFERENCE = [7, 19, 23, 101, 57, 88, 200, 31, 64, 12, 5, 99]


async def reference_tokens(client) -> list[int]:
    result = await client.generate_all(prompt_token_ids=REFERENCE, max_tokens=8,
                                       temperature=0.0, ignore_eos=True, timeout_s=DEADLINE_S)  # fmt: skip
    return result.token_ids


@pytest.fixture
def nobody_port():
    """A loopback port where nobody listens, and nobody can start to, during the test."""
    with unlistened_port() as port:
        yield port


def test_forged_and_oversized_kv_frames(fault_cluster):
    cluster = fault_cluster
    name = "decode-0"
    rss_before = cluster.rss_mib(name)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(cluster.kv_addresses[name])
    try:
        sock.send_multipart([b"\xff not a protobuf header"])
        stray = protocol.encode(uuid.uuid4().hex, 0, layer_manifest=transfer_pb2.LayerManifest(
            layer_idx=0, num_blocks=1, num_bytes=4096, token_end=4))  # fmt: skip
        sock.send_multipart([stray, b"\x00" * 4096])  # a layer for no transfer
        handshake = transfer_pb2.TransferHandshake(src_address="tcp://127.0.0.1:1")
        sock.send_multipart([protocol.encode(uuid.uuid4().hex, 0, handshake=handshake)])
        payload = np.zeros(OVERSIZED_BYTES, dtype=np.uint8)
        sock.send_multipart([stray, memoryview(payload)], copy=False)
        peak = rss_before
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # the frame would have arrived by now
            peak = max(peak, cluster.rss_mib(name))
            time.sleep(0.05)
    finally:
        sock.close()
        ctx.term()

    async def main():
        async with cluster.router() as (router, client):
            await wait_registered(router)
            return await burst(client, prompts(6, seed=21), DEADLINE_S, max_tokens=8)

    outcomes = asyncio.run(main())
    growth = peak - rss_before
    cluster.check("forged + oversized (256 MiB) KV frames to the tcp KV port", outcomes, ALL,
                  DEADLINE_S, notes=f"RSS +{growth:.0f} MiB", min_completed=len(outcomes))  # fmt: skip
    assert growth < MAX_FRAME_RSS_GROWTH_MIB, f"RSS grew {growth:.0f} MiB"


def test_forged_tickets(fault_cluster, nobody_port):
    """Tickets nobody issued: one names the decode node's KV address (no such transfer there),
    one an address where nobody listens. The prefill node gives up within its transfer timeout,
    frees everything; the decode node allocates nothing; outputs are unchanged."""
    cluster = fault_cluster

    async def forged_prefill(stub, layout_hash: str, dst_address: str) -> Outcome:
        ids = prompts(1, seed=22, min_len=12, max_len=12)[0]
        ticket = node_pb2.TransferTicket(
            transfer_id=uuid.uuid4().hex, dst_address=dst_address, layout_hash=layout_hash,
            dst_block_ids=list(range(4)), num_tokens=len(ids),
        )  # fmt: skip
        request = node_pb2.PrefillRequest(
            request_id=uuid.uuid4().hex, prompt_token_ids=ids, ticket=ticket,
            sampling=node_pb2.NodeSamplingParams(max_tokens=4, temperature=0.0),
        )  # fmt: skip
        outcome, start = Outcome(), time.monotonic()
        try:
            async for message in stub.Prefill(request, timeout=DEADLINE_S):
                if message.WhichOneof("kind") == "transfer_result":
                    assert not message.transfer_result.ok
                    outcome.code = grpc.StatusCode.ABORTED  # the hand-off failed, and said why
                    outcome.details = message.transfer_result.error
        except grpc.aio.AioRpcError as error:
            outcome.code, outcome.details = error.code(), error.details() or ""
        outcome.elapsed_s = time.monotonic() - start
        return outcome

    async def main():
        async with cluster.router() as (router, client):
            await wait_registered(router)
            before = await reference_tokens(client)
            async with grpc.aio.insecure_channel(cluster.address("prefill-0")) as channel:
                info = await node_pb2_grpc.NodeStub(channel).GetNodeInfo(
                    node_pb2.GetNodeInfoRequest(), timeout=10)  # fmt: skip
                stub = node_pb2_grpc.PrefillNodeStub(channel)
                outcomes = await asyncio.gather(
                    forged_prefill(stub, info.layout_hash, cluster.kv_addresses["decode-0"]),
                    forged_prefill(stub, info.layout_hash, f"tcp://127.0.0.1:{nobody_port}"),
                )
            after = await reference_tokens(client)
            return outcomes, before, after

    outcomes, before, after = asyncio.run(main())
    allowed = frozenset({grpc.StatusCode.ABORTED})
    cluster.check("forged tickets (to D's KV port; to nobody)", outcomes, ALL, DEADLINE_S,
                  allowed=allowed, min_completed=0)  # fmt: skip
    assert all(o.elapsed_s < 3 * TRANSFER_TIMEOUT_S for o in outcomes), outcomes
    assert before == after


def test_forged_registry_records(fault_cluster, nobody_port):
    """Records nobody's node wrote: a decode node at an address where nobody listens, and the
    prefill node's address claiming to be a decode node. Requests still complete."""
    cluster = fault_cluster
    with cluster.redis.client() as redis:
        real = [NodeRecord.from_json(redis.get(k)) for k in redis.scan_iter(NODE_KEY_PATTERN)]
        decode = next(r for r in real if r.role == "decode")
        prefill = next(r for r in real if r.role == "prefill")
        forged = [
            dataclasses.replace(decode, node_id="forged-nobody",
                                address=f"127.0.0.1:{nobody_port}", updated_at_s=time.time()),
            dataclasses.replace(prefill, node_id="forged-role", role="decode",
                                updated_at_s=time.time()),
        ]  # fmt: skip
        for record in forged:
            redis.set(record.key, record.to_json(), ex=120)

    async def main():
        try:
            async with cluster.router() as (router, client):
                await wait_registered(router)
                await asyncio.sleep(1.0)  # the router has seen (and judged) the forged records
                outcomes = await burst(client, prompts(8, seed=23), DEADLINE_S, max_tokens=8)
                return outcomes, len(router.registry.decode_nodes)
        finally:
            with cluster.redis.client() as redis:
                redis.delete(*(r.key for r in forged))

    outcomes, num_decode = asyncio.run(main())
    cluster.check("forged registry records (dead address; wrong role)", outcomes, ALL,
                  DEADLINE_S, notes=f"decode nodes admitted={num_decode}",
                  min_completed=len(outcomes))  # fmt: skip
    assert num_decode == 2


MALFORMED = [
    dict(prompt_token_ids=[]),
    dict(prompt_token_ids=[600, 3, 4]),  # outside the vocabulary (512)
    dict(prompt_token_ids=list(range(3, 503)) * 3),  # longer than the model's 1024 positions
    dict(prompt_token_ids=[5, 6], temperature=-1.0),
    dict(prompt_token_ids=[5, 6], top_p=1.5),
    dict(prompt_token_ids=[5, 6], max_tokens=10**9),
    dict(prompt_token_ids=[5, 6], logprobs=1000),
    dict(prompt="text, but this model has no tokenizer"),
]


def test_malformed_requests(fault_cluster):
    cluster = fault_cluster

    async def main():
        async with cluster.router() as (router, client):
            await wait_registered(router)
            outcomes = await asyncio.gather(*(run_one(client, DEADLINE_S, **fields)
                                              for fields in MALFORMED))  # fmt: skip
            async with grpc.aio.insecure_channel(cluster.address("decode-0")) as channel:
                stub = node_pb2_grpc.DecodeNodeStub(channel)
                outcomes.append(await _raw(stub.Decode(node_pb2.DecodeRequest(
                    request_id="no-mode", prompt_token_ids=[5, 6]), timeout=DEADLINE_S)))  # fmt: skip
                outcomes.append(await _raw(stub.Decode(node_pb2.DecodeRequest(
                    request_id="", prompt_token_ids=[5, 6],
                    mode=node_pb2.DECODE_MODE_LOCAL_PREFILL), timeout=DEADLINE_S)))  # fmt: skip
            return outcomes

    outcomes = asyncio.run(main())
    allowed = frozenset({grpc.StatusCode.INVALID_ARGUMENT})
    cluster.check("malformed requests (router and node)", outcomes, ALL, DEADLINE_S,
                  allowed=allowed, min_completed=0)  # fmt: skip
    assert all(o.code == grpc.StatusCode.INVALID_ARGUMENT for o in outcomes), [
        (o.code, o.details) for o in outcomes
    ]


async def _raw(call) -> Outcome:
    outcome, start = Outcome(), time.monotonic()
    try:
        async for _ in call:
            outcome.num_tokens += 1
    except grpc.aio.AioRpcError as error:
        outcome.code, outcome.details = error.code(), error.details() or ""
    outcome.elapsed_s = time.monotonic() - start
    return outcome
