"""A hand-driven prefill node: a raw transport endpoint that speaks transfer.proto to one
receiver, honestly or not (tests of what the receiver refuses, takeovers, authentication).
Forged payloads are filled with MARKER, so "no block written" means no MARKER anywhere. Given
a cluster secret (`auth`), `hello()` takes the receiver's challenge, and from then on the
handshake proves it and every message carries its MAC, as an honest sender's do."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import torch
from transfer_helpers import RawPeer, make_layout, make_raw_peer, sentinel_caches

from cache_transfer import KVReceiver, KVTransferManager, make_transport, protocol
from cache_transfer.frame_auth.frame_key import TO_RECEIVER, FrameKey, seal
from cache_transfer.tickets import handshake_proof
from pdserve.security import ClusterAuth
from pdserve.v1 import transfer_pb2

MARKER = 99.0
LAYOUT = make_layout(block_size=4)  # 3 layers
NUM_TOKENS = 10  # 3 blocks of KV
DST_BLOCK_IDS = [6, 2, 9, 4]


@dataclass
class Forger:
    """A hand-driven prefill node talking to one receiver."""

    peer: RawPeer
    receiver: KVReceiver
    seq: int = 0
    auth: ClusterAuth | None = None  # the secret it holds (None: it proves nothing)
    nonce: bytes | None = None  # its connection's challenge (`hello`)
    key: FrameKey | None = None  # the MAC key that challenge gives (with `auth`)
    headers: list[bytes] = field(default_factory=list)  # every header it sent, as sent

    @property
    def address(self) -> str:
        return self.receiver.ticket().dst_address

    @property
    def connection(self) -> str:
        return self.peer.transport.connection_id(self.address)

    async def hello(self) -> None:
        """Ask for a challenge and wait for it (on the forger's own connection)."""
        hello = transfer_pb2.TransferHello(src_address=self.peer.transport.address)
        header = protocol.encode(self.receiver.transfer_id, 0, hello=hello)
        await asyncio.wait_for(self.peer.transport.send(self.address, header), 5)
        self.nonce = (await self.next_reply("challenge", 10.0)).challenge.nonce
        if self.auth is not None:
            self.key = FrameKey(self.auth, self.receiver.transfer_id, self.nonce, self.connection)

    async def next_reply(self, kind: str, timeout_s: float) -> protocol.TransferMessage:
        """The first reply of `kind` received (waited for)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while loop.time() < deadline:
            for _, header in self.peer.received:
                msg = protocol.decode(header)
                if protocol.kind_of(msg) == kind:
                    return msg
            await asyncio.sleep(0.01)
        raise TimeoutError(f"no {kind} reply within {timeout_s} s")

    def proof(self) -> bytes:
        """This forger's handshake proof for its challenge (`hello` first)."""
        assert self.auth is not None and self.nonce is not None
        return handshake_proof(self.auth, self.receiver.ticket(), self.peer.transport.address,
                               self.nonce, self.connection)  # fmt: skip

    async def send(
        self,
        payload: torch.Tensor | None = None,
        *,
        seq: int | None = None,
        transfer_id: str | None = None,
        **kind: object,
    ) -> None:
        transfer_id = transfer_id or self.receiver.transfer_id
        seq = self.seq if seq is None else seq
        header = protocol.encode(transfer_id, seq, **kind)
        if self.key is not None:  # MACed as an honest sender does (bytes of a host payload)
            part = [] if payload is None else [memoryview(payload.numpy())]
            header = seal(header, self.key.tag(TO_RECEIVER, seq, header, part))
        self.seq += 1
        self.headers.append(header)
        await self.send_raw(header, payload)

    async def send_raw(self, header: bytes, payload: torch.Tensor | None = None) -> None:
        """Bytes as they are (a captured header, replayed)."""
        await asyncio.wait_for(self.peer.transport.send(self.address, header, payload), 5)

    async def handshake(self, **overrides: object) -> None:
        fields: dict[str, object] = dict(
            protocol_version=protocol.PROTOCOL_VERSION,
            layout_hash=LAYOUT.layout_hash(),
            src_address=self.peer.transport.address,
            num_layers=LAYOUT.num_layers,
            num_tokens=NUM_TOKENS,
            num_blocks=3,
        )
        if self.auth is not None and self.nonce is not None:
            fields["proof"] = self.proof()
        await self.send(handshake=transfer_pb2.TransferHandshake(**{**fields, **overrides}))

    async def layer(
        self,
        layer_idx: int,
        value: float = MARKER,
        payload_blocks: int = 3,
        seq: int | None = None,
        transfer_id: str | None = None,
        **overrides: object,
    ) -> None:
        fields: dict[str, object] = dict(
            layer_idx=layer_idx,
            block_offset=0,
            num_blocks=3,
            num_bytes=LAYOUT.layer_bytes(3),
            token_end=NUM_TOKENS,
        )
        manifest = transfer_pb2.LayerManifest(**{**fields, **overrides})  # type: ignore[arg-type]
        payload = torch.full((2, payload_blocks, *LAYOUT.block_shape), value).view(torch.uint8)
        await self.send(
            payload.flatten(), seq=seq, transfer_id=transfer_id, layer_manifest=manifest
        )

    async def first_token(self) -> None:
        await self.send(first_token=transfer_pb2.FirstToken(token_id=5))


async def full_transfer(f: Forger) -> None:
    await f.handshake()
    for layer_idx in range(LAYOUT.num_layers):
        await f.layer(layer_idx, value=1.0)
    await f.first_token()


async def forged_session(backend: str) -> tuple[KVTransferManager, KVReceiver, Forger]:
    """A decode node's manager, one receiver of it, and a forger speaking to that receiver."""
    dst = sentinel_caches(LAYOUT, num_blocks=12)
    manager = KVTransferManager(make_transport(backend), LAYOUT, dst)
    receiver = manager.create_receiver(DST_BLOCK_IDS, NUM_TOKENS, timeout_s=10)
    return manager, receiver, Forger(await make_raw_peer(backend), receiver)


def caches(manager: KVTransferManager) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The manager's KV caches (where received KV lands)."""
    return list(manager._kv_caches or [])


def no_marker(manager: KVTransferManager) -> bool:
    """No forged byte landed anywhere in the manager's caches."""
    return not any(bool((k == MARKER).any() or (v == MARKER).any()) for k, v in caches(manager))
