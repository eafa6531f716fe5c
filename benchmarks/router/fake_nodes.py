"""Instant prefill and decode nodes for `pd-bench router`: the real node gRPC protocol
(node.proto), no model, every answer at once, one process per node.

```
python -m benchmarks.router.fake_nodes --role decode|prefill [--port 0] [--chunk-tokens 16]
  prints "fake-node listening on ADDR (kv udp://127.0.0.1:PORT)" once serving; SIGINT/SIGTERM
  stop it and print one JSON line of its handler times ("fake-node times {...}")

decode   Decode(LOCAL_PREFILL)  ──► TokenChunks at once: max_tokens tokens, chunk_tokens each
         Decode(DISAGGREGATED)  ──► TransferTicket{dst_address: udp://...} at once
                                    ... the prefill node's datagram (the "KV") ──► TokenChunks
                                    (none within HANDOFF_TIMEOUT_S: tokens anyway, counted)
         CancelTransfer         ──► the awaited datagram counts as in
prefill  Prefill                ──► PrefillFirstToken at once
                                    ... its ticket (inline, or AttachTicket) ──► one datagram
                                    to the ticket's dst_address ──► PrefillTransferResult(ok)
```

The hand-off is a UDP datagram on loopback carrying the transfer id, standing in for the KV:
the decode node's tokens wait for it as a real one waits for every layer, so the router's whole
disaggregated path (ticket, AttachTicket, first token, tokens) is on the request's clock.

Handler times (per request: entry to last message handed to gRPC, less the waits on the router
or the other node) are what the nodes themselves spend; `pd-bench router` prints them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc

from pdserve.v1 import node_pb2, node_pb2_grpc

HANDOFF_TIMEOUT_S = 10.0  # the decode node's wait for the prefill node's datagram
TICKET_TIMEOUT_S = 10.0  # the prefill node's wait for an AttachTicket
VOCAB_SIZE = 32000
MAX_MODEL_LEN = 4096
MAX_TIMES_KEPT = 200_000  # handler times kept per node (memory bound for long runs)
SERVER_OPTIONS = (("grpc.so_reuseport", 0),)


def node_info(role: node_pb2.NodeRole) -> node_pb2.NodeInfo:
    """What both fake roles report: the router pairs them (same model, layout, transport)."""
    return node_pb2.NodeInfo(
        role=role, model_name="synthetic:instant", layout_hash="instant-layout",
        max_model_len=MAX_MODEL_LEN, vocab_size=VOCAB_SIZE, eos_token_ids=[2], block_size=16,
        kv_transport="tcp", protocol_version=1, max_num_seqs=1024,
    )  # fmt: skip


class _Datagrams(asyncio.DatagramProtocol):
    """The decode node's hand-off socket: each datagram is a transfer id whose KV is "in"."""

    def __init__(self, waiting: dict[str, asyncio.Future[None]]) -> None:
        self._waiting = waiting

    def datagram_received(self, data: bytes, addr: tuple[str | Any, int]) -> None:
        future = self._waiting.get(data.decode())
        if future is not None and not future.done():
            future.set_result(None)


class FakeNode(
    node_pb2_grpc.NodeServicer, node_pb2_grpc.PrefillNodeServicer, node_pb2_grpc.DecodeNodeServicer
):
    """One instant node of either role (the role decides which services are added)."""

    def __init__(self, role: node_pb2.NodeRole, chunk_tokens: int) -> None:
        self.info = node_info(role)
        self.chunk_tokens = chunk_tokens
        self.handler_s: list[float] = []  # per request, waits excluded
        self.num_handoff_timeouts = 0
        self.kv_address = ""
        self._waiting: dict[str, asyncio.Future[None]] = {}  # decode: transfer id -> the KV
        self._tickets: dict[str, asyncio.Future[node_pb2.TransferTicket]] = {}  # prefill
        self._send: asyncio.DatagramTransport | None = None  # prefill: its datagram socket

    async def open_kv(self) -> None:
        loop = asyncio.get_running_loop()
        if self.info.role == node_pb2.NODE_ROLE_DECODE:
            transport, _ = await loop.create_datagram_endpoint(
                lambda: _Datagrams(self._waiting), local_addr=("127.0.0.1", 0)
            )
            host, port = transport.get_extra_info("sockname")[:2]
            self.kv_address = f"udp://{host}:{port}"
        else:
            self._send, _ = await loop.create_datagram_endpoint(
                asyncio.DatagramProtocol, local_addr=("127.0.0.1", 0)
            )

    def _timed(self, seconds: float) -> None:
        if len(self.handler_s) < MAX_TIMES_KEPT:
            self.handler_s.append(seconds)

    # ---- Node ----------------------------------------------------------------------------

    async def GetNodeInfo(self, request: Any, context: Any) -> node_pb2.NodeInfo:
        return self.info

    async def GetStats(self, request: Any, context: Any) -> node_pb2.NodeStats:
        return node_pb2.NodeStats(num_kv_blocks=1 << 20, num_free_kv_blocks=1 << 20)

    async def GetTokenizer(self, request: Any, context: Any) -> node_pb2.TokenizerFiles:
        return node_pb2.TokenizerFiles()  # none: the router takes token ids

    async def Abort(self, request: Any, context: Any) -> node_pb2.AbortResponse:
        return node_pb2.AbortResponse(found=False)

    # ---- DecodeNode ----------------------------------------------------------------------

    async def Decode(
        self, request: node_pb2.DecodeRequest, context: Any
    ) -> AsyncIterator[node_pb2.DecodeResponse]:
        start_s = time.perf_counter()
        waited_s = 0.0
        if request.mode == node_pb2.DECODE_MODE_DISAGGREGATED:
            transfer_id = uuid.uuid4().hex
            kv_in = self._waiting[transfer_id] = asyncio.get_running_loop().create_future()
            ticket = node_pb2.TransferTicket(
                transfer_id=transfer_id, dst_address=self.kv_address, layout_hash=
                self.info.layout_hash, num_tokens=len(request.prompt_token_ids),
            )  # fmt: skip
            yield node_pb2.DecodeResponse(ticket=ticket)
            wait_start_s = time.perf_counter()
            try:
                await asyncio.wait_for(kv_in, HANDOFF_TIMEOUT_S)
            except TimeoutError:
                self.num_handoff_timeouts += 1
            finally:
                del self._waiting[transfer_id]
            waited_s = time.perf_counter() - wait_start_s
        max_tokens = request.sampling.max_tokens or 16
        for index in range(0, max_tokens, self.chunk_tokens):
            ids = [(7 + i) % VOCAB_SIZE for i in range(index, min(index + self.chunk_tokens,
                                                                  max_tokens))]  # fmt: skip
            last = index + len(ids) >= max_tokens
            chunk = node_pb2.TokenChunk(
                output_index=index, token_ids=ids, finish_reason="length" if last else ""
            )
            if last:
                self._timed(time.perf_counter() - start_s - waited_s)
            yield node_pb2.DecodeResponse(tokens=chunk)

    async def CancelTransfer(
        self, request: node_pb2.CancelTransferRequest, context: Any
    ) -> node_pb2.CancelTransferResponse:
        future = self._waiting.get(request.transfer_id)
        found = future is not None and not future.done()
        if future is not None and not future.done():
            future.set_result(None)
        return node_pb2.CancelTransferResponse(found=found)

    # ---- PrefillNode ---------------------------------------------------------------------

    async def Prefill(
        self, request: node_pb2.PrefillRequest, context: Any
    ) -> AsyncIterator[node_pb2.PrefillResponse]:
        start_s = time.perf_counter()
        first = node_pb2.PrefillFirstToken(token_id=7)
        yield node_pb2.PrefillResponse(first_token=first)
        wait_start_s = time.perf_counter()
        if request.HasField("ticket"):
            ticket = request.ticket
        else:
            future = self._ticket_future(request.request_id)
            try:
                ticket = await asyncio.wait_for(future, TICKET_TIMEOUT_S)
            finally:
                self._tickets.pop(request.request_id, None)
        waited_s = time.perf_counter() - wait_start_s
        host, port = ticket.dst_address.removeprefix("udp://").rsplit(":", 1)
        assert self._send is not None
        self._send.sendto(ticket.transfer_id.encode(), (host, int(port)))
        self._timed(time.perf_counter() - start_s - waited_s)
        yield node_pb2.PrefillResponse(transfer_result=node_pb2.PrefillTransferResult(ok=True))

    async def AttachTicket(
        self, request: node_pb2.AttachTicketRequest, context: Any
    ) -> node_pb2.AttachTicketResponse:
        future = self._ticket_future(request.request_id)
        if not future.done():
            future.set_result(request.ticket)
        return node_pb2.AttachTicketResponse()

    def _ticket_future(self, request_id: str) -> asyncio.Future[node_pb2.TransferTicket]:
        future = self._tickets.get(request_id)
        if future is None:
            future = self._tickets[request_id] = asyncio.get_running_loop().create_future()
        return future

    def times(self) -> dict[str, Any]:
        return {"handler_s": self.handler_s, "handoff_timeouts": self.num_handoff_timeouts}


async def serve(role: node_pb2.NodeRole, port: int, chunk_tokens: int) -> None:
    node = FakeNode(role, chunk_tokens)
    await node.open_kv()
    server = grpc.aio.server(options=SERVER_OPTIONS)
    node_pb2_grpc.add_NodeServicer_to_server(node, server)
    if role == node_pb2.NODE_ROLE_DECODE:
        node_pb2_grpc.add_DecodeNodeServicer_to_server(node, server)
    else:
        node_pb2_grpc.add_PrefillNodeServicer_to_server(node, server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    print(f"fake-node listening on 127.0.0.1:{bound} (kv {node.kv_address or '-'})", flush=True)
    await stop.wait()
    await server.stop(grace=None)
    print(f"fake-node times {json.dumps(node.times())}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fake_nodes", description="an instant pdserve node")
    parser.add_argument("--role", choices=["prefill", "decode"], required=True)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--chunk-tokens", type=int, default=16, help="tokens per TokenChunk")
    parser.add_argument("--uvloop", action="store_true", help="run on uvloop")
    args = parser.parse_args(argv)
    role = node_pb2.NODE_ROLE_DECODE if args.role == "decode" else node_pb2.NODE_ROLE_PREFILL
    if args.uvloop:
        import uvloop

        uvloop.run(serve(role, args.port, max(1, args.chunk_tokens)))
    else:
        asyncio.run(serve(role, args.port, max(1, args.chunk_tokens)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
