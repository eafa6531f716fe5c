"""`RawPeer`: a bare KV transport endpoint for node tests (re-exported by node_harness)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import torch

from cache_transfer import KVLayout, make_transport, protocol
from cache_transfer.transports.base import KVTransport
from pdserve.v1 import node_pb2, transfer_pb2

RPC_TIMEOUT_S = 10.0


@dataclass
class RawPeer:
    """A bare KV transport endpoint that speaks transfer.proto by hand: it records what it
    receives and sends whatever a test tells it to (forged messages included). A sender's
    hello it answers at once with a challenge (no proof: an open cluster), as a receiver does,
    and keeps apart (`hellos`)."""

    transport: KVTransport
    received: list[transfer_pb2.TransferMessage] = field(default_factory=list)
    seq: int = 0
    hellos: list[transfer_pb2.TransferMessage] = field(default_factory=list)
    _replies: set[asyncio.Task[None]] = field(default_factory=set)

    @classmethod
    def start(cls, transport_name: str) -> RawPeer:
        peer = cls(make_transport(transport_name))
        peer.transport.start(peer)
        return peer

    @property
    def address(self) -> str:
        return self.transport.address

    def prepare(self, peer_id: str, header: bytes, payload_bytes: int) -> torch.Tensor:
        return torch.empty(payload_bytes, dtype=torch.uint8)

    def complete(self, peer_id: str, header: bytes, payload: torch.Tensor | None) -> None:
        msg = protocol.decode(header)
        if protocol.kind_of(msg) != "hello":
            self.received.append(msg)
            return
        self.hellos.append(msg)
        challenge = transfer_pb2.HandshakeChallenge(nonce=bytes(16), connection=peer_id)
        header = protocol.encode(msg.transfer_id, 0, challenge=challenge)
        reply = self.transport.send(msg.hello.src_address, header)
        task = asyncio.ensure_future(asyncio.wait_for(reply, RPC_TIMEOUT_S))
        self._replies.add(task)
        task.add_done_callback(self._replies.discard)

    def kinds(self) -> list[str]:
        return [protocol.kind_of(msg) for msg in self.received]

    async def send(
        self,
        dst_address: str,
        transfer_id: str,
        payload: torch.Tensor | None = None,
        **kind: object,
    ) -> None:
        header = protocol.encode(transfer_id, self.seq, **kind)
        self.seq += 1
        await asyncio.wait_for(self.transport.send(dst_address, header, payload), RPC_TIMEOUT_S)

    async def handshake(self, ticket: node_pb2.TransferTicket, layout: KVLayout) -> None:
        """A valid handshake for `ticket`, as a prefill node would send it."""
        handshake = transfer_pb2.TransferHandshake(
            protocol_version=protocol.PROTOCOL_VERSION,
            layout_hash=layout.layout_hash(),
            src_address=self.address,
            num_layers=layout.num_layers,
            num_tokens=ticket.num_tokens,
            num_blocks=layout.num_blocks_for(ticket.num_tokens),
        )
        await self.send(ticket.dst_address, ticket.transfer_id, handshake=handshake)

    async def close(self) -> None:
        await self.transport.close()
