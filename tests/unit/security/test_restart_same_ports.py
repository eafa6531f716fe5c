"""Issue 15: a node restarted on its old ports right after `kill -9` serves (the killed node's
connections leave its ports in TIME_WAIT; gRPC and zmq listeners set SO_REUSEADDR, and a port
still held is retried for --bind-retry-s). Real `pd-decode` processes, tcp KV transport."""

from __future__ import annotations

import asyncio
import signal
import socket

import grpc
import psutil
import pytest

from cache_transfer.transports import ucx_available
from pdserve.v1 import node_pb2_grpc
from tests.unit.decode_node.node_harness import (
    RPC_TIMEOUT_S,
    NodeProcess,
    decode_request,
    prompt,
    read_chunks,
    tokens_of,
)

pytestmark = pytest.mark.timeout(300)
needs_ucx = pytest.mark.skipif(not ucx_available(), reason="ucxx does not import here")


async def _serve_one(address: str, request_id: str) -> list[int]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = node_pb2_grpc.DecodeNodeStub(channel)
        call = stub.Decode(
            decode_request(request_id, prompt(9, seed=1), disaggregated=False),
            timeout=RPC_TIMEOUT_S * 3,
        )
        return tokens_of(await read_chunks(call))


@pytest.mark.parametrize("transport", ["tcp", pytest.param("ucx", marks=needs_ucx)])
def test_a_node_restarted_on_its_ports_after_kill_9_serves(transport: str) -> None:
    # The first start binds free ports itself (port 0) and says which: nothing can take them
    # between a pick and the bind. The restart then asks for exactly those.
    first = NodeProcess.launch("decode_node.cli", "--kv-transport", transport)
    port = int(first.address.rsplit(":", 1)[1])
    kv_port = int(first.match[4].rsplit(":", 1)[1])
    flags = ("--port", str(port), "--kv-port", str(kv_port), "--kv-transport", transport)
    # Live connections to both ports when the node dies: the node's side closes first.
    peers = [socket.create_connection(("127.0.0.1", p), timeout=10) for p in (port, kv_port)]
    try:
        before = asyncio.run(asyncio.wait_for(_serve_one(first.address, "before"), 120))
        first.process.send_signal(signal.SIGKILL)
        first.process.wait(timeout=30)
        for peer in peers:  # read to the dead node's FIN, then close cleanly
            while peer.recv(65536):
                pass
    finally:
        for peer in peers:
            peer.close()
    # What made the old restart fail: the killed node's ports are still in TIME_WAIT.
    for p in (port, kv_port):
        states = {c.status for c in psutil.net_connections("tcp") if c.laddr and c.laddr.port == p}
        assert psutil.CONN_TIME_WAIT in states, (p, states)
    second = NodeProcess.launch("decode_node.cli", *flags)  # at once, the same ports
    try:
        assert second.address == first.address
        assert second.match[4].endswith(f":{kv_port}")
        after = asyncio.run(asyncio.wait_for(_serve_one(second.address, "after"), 120))
        assert after == before  # greedy, the same tiny model: the same tokens
    finally:
        second.process.kill()
        second.process.wait(timeout=30)
