"""`KVSender`: the prefill side of one KV hand-off.

    created from the ticket ── start() ── handshake ──► BOOTSTRAPPING ── ack ──► WAITING
    (started at creation unless given start_timeout_s: a prefill node starts it, and the
    transfer's deadline, when the engine starts the prefill)
    send_layer(i, ...) as each layer's KV is written (any layer order; chunks in token order),
    send_layers([(i, k, v), (j, k, v)...]) for several at once (one message),
    or send_packed(i, payload) for a layer the caller packed itself, or
    send_packed_layers([(i, payload), (j, payload)...]) for several at once (one message)
        ──► TRANSFERRING ── send_first_token() ── result ok ──► SUCCESS
    refused handshake, the deadline, a transport error, abort(), or a failed result ──► FAILED

Layers wait for the handshake's ack before they are packed, so a refused layout costs no
bandwidth. The node releases the request's blocks once `wait()` returns.

Writes in place (given `sharing`, `kv_device`): a receiver on our own GPU that grants it gets
each layer written into its blocks by us (`InPlaceWriter`: copied block to block from our
cache, or unpacked if the caller packed it), then a manifest without payload; a granted sender that fails says so once its writes drained (cache_transfer/README.md).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import torch

from cache_transfer.checked_caches import derived
from cache_transfer.in_place_sender import InPlaceSending, Source
from cache_transfer.in_place_writer import InPlaceWriter
from cache_transfer.layout import KVLayout
from cache_transfer.packing import CheckedIds, LayerBlocks, check_block_ids, check_kv_cache
from cache_transfer.pool_sharing import PoolSharing
from cache_transfer.protocol import PROTOCOL_VERSION, TransferMessage, kind_of
from cache_transfer.session import TransferSession
from cache_transfer.staging_pool import StagingPool
from cache_transfer.state import TransferState
from cache_transfer.ticket_auth import check_ticket, handshake_proof
from cache_transfer.transports.base import KVTransport, check_payload
from pdserve.security import ClusterAuth
from pdserve.v1 import generation_pb2, node_pb2, transfer_pb2

logger = logging.getLogger(__name__)


class KVSender(InPlaceSending, TransferSession):
    role = "sender"

    def __init__(
        self,
        transport: KVTransport,
        staging: StagingPool,
        layout: KVLayout,
        ticket: node_pb2.TransferTicket,
        timeout_s: float,
        auth: ClusterAuth | None = None,
        start_timeout_s: float | None = None,
        sharing: PoolSharing | None = None,
        kv_device: str = "",
        device: torch.device | None = None,
    ) -> None:
        """`sharing`, `kv_device`, `device`: write in place (see above) into a receiver on
        `kv_device` (this node's cache's, as tickets name it), mapping its pool on `device`.
        With `auth`, a ticket whose signature does not verify fails the session at once and
        nobody is contacted (its dst_address may be anyone's); the handshake proves the secret.
        The handshake goes out at the start (TransferSession)."""
        super().__init__(transport, ticket.transfer_id, timeout_s, start_timeout_s)
        self._auth = auth
        self._ticket = ticket
        self.layout = layout
        self.num_tokens = ticket.num_tokens
        self.num_blocks = layout.num_blocks_for(ticket.num_tokens)
        self.num_bytes_sent = 0  # KV bytes handed to the transport (or written in place)
        self._peer_address = ticket.dst_address or None
        self._layer_token_end = [0] * layout.num_layers  # tokens of each layer handed to send
        self._handshake_resolved = asyncio.Event()  # acked, or the session finished
        self.add_finish_callback(lambda _: self._handshake_resolved.set())
        self._first_token_sent = False
        # layer sends whose messages the transport has not numbered yet (send_first_token
        # goes right behind them: the transport keeps that order, so it need not wait for them
        # to complete)
        self._unsubmitted: set[asyncio.Future[None]] = set()
        self._staging = staging
        self._sharing = sharing
        self._kv_device = kv_device
        self._device = device
        self.in_place = False  # the receiver granted writes in place
        self._writer: InPlaceWriter | None = None  # ... and its pool is mapped here
        forged = check_ticket(auth, ticket) if auth is not None else None
        reason = self._check_ticket(ticket)
        if forged is not None:
            self.fail(f"refused the ticket: {forged}", notify_peer=False)
        elif reason is not None:
            self.fail(f"refused the ticket: {reason}")
        elif self.started:
            self.spawn(self._handshake())

    @property
    def dst_kv_device(self) -> str:
        """The device the receiver's KV cache lives on, as its ticket names it ("" unknown)."""
        return self._ticket.kv_device

    def _on_start(self) -> None:
        self.spawn(self._handshake())

    async def send_layer(
        self,
        layer_idx: int,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        src_block_ids: Sequence[int],
        token_end: int | None = None,
    ) -> None:
        """Send layer `layer_idx`'s KV of the prompt up to `token_end` (default: all of it).

        `src_block_ids` is the request's block table; the blocks not yet sent for this layer
        go out (a chunked prefill calls this once per chunk). A no-op once finished."""
        await self.send_layers([(layer_idx, k_cache, v_cache)], src_block_ids, token_end)

    async def send_layers(
        self,
        layers: Sequence[tuple[int, torch.Tensor, torch.Tensor]],
        src_block_ids: Sequence[int],
        token_end: int | None = None,
    ) -> None:
        """`send_layer` for several `(layer_idx, k_cache, v_cache)` (distinct layers, caches on
        one device) as one message: packed into staging and sent, or, written in place, copied
        block to block into the receiver's blocks (nothing packed) and announced in one
        header. ValueError, nothing sent, when any is wrong."""
        token_end = self.num_tokens if token_end is None else token_end
        if len({layer_idx for layer_idx, _, _ in layers}) != len(layers) or not layers:
            raise ValueError(f"send_layers needs distinct layers, got {len(layers)}")
        manifests, sources = [], []
        span_ids: dict[tuple, CheckedIds] = {}  # checked once per span and pool, not per layer
        caches = [cache for _, k_cache, v_cache in layers for cache in (k_cache, v_cache)]
        if derived(caches, lambda: self._check_caches(layers)) != self.layout:
            self._check_caches(layers)  # checked against another layout before
        for layer_idx, k_cache, v_cache in layers:
            span = self._layer_span(layer_idx, token_end)
            if len(src_block_ids) < span[1]:
                raise ValueError(
                    f"{token_end} tokens span {span[1]} blocks; src_block_ids has "
                    f"{len(src_block_ids)}"
                )
            key = (*span, k_cache.shape[0], k_cache.device)
            if key not in span_ids:
                ids = src_block_ids[span[0] : span[1]]
                span_ids[key] = check_block_ids(ids, k_cache.shape[0], k_cache.device)
            manifests.append(self._manifest(layer_idx, *span, token_end))
            sources.append(LayerBlocks(k_cache, v_cache, span_ids[key]))
        for layer_idx, _, _ in layers:
            self._layer_token_end[layer_idx] = token_end
        await self._send_layers(manifests, sources, layers[0][1].device)

    def _check_caches(self, layers: Sequence[tuple[int, torch.Tensor, torch.Tensor]]) -> KVLayout:
        """ValueError unless every layer's caches fit our layout (kept per set of caches by
        `derived`: the same ones every request, so checked once, not 32 times a request)."""
        for _, k_cache, v_cache in layers:
            check_kv_cache(self.layout, k_cache, v_cache)
        return self.layout

    async def send_packed(
        self, layer_idx: int, payload: torch.Tensor, token_end: int | None = None
    ) -> None:
        """Send layer `layer_idx`'s KV packed already (by `pack_layer`): the request's blocks
        not yet sent for this layer up to `ceil(token_end / block_size)`, in order, as flat
        uint8. Sent in place when it lives where the transport sends from
        (`buffer_device`), else copied once into staging; leave it unchanged until this
        returns. A CUDA payload must be written on the current stream. No-op once finished."""
        await self.send_packed_layers([(layer_idx, payload)], token_end)

    async def send_packed_layers(
        self, layers: Sequence[tuple[int, torch.Tensor]], token_end: int | None = None
    ) -> None:
        """`send_packed` for several layers (distinct, same `token_end`) as one transport
        message (`KVTransport.send_many`): fewer, larger messages. The receiver lands and
        reports each layer as if sent alone. ValueError, nothing sent, when any is wrong."""
        token_end = self.num_tokens if token_end is None else token_end
        if len({layer_idx for layer_idx, _ in layers}) != len(layers) or not layers:
            raise ValueError(f"send_packed_layers needs distinct layers, got {len(layers)}")
        manifests = []
        for layer_idx, payload in layers:
            block_offset, block_end = self._layer_span(layer_idx, token_end)
            num_bytes = self.layout.layer_bytes(block_end - block_offset)
            if check_payload(payload) != num_bytes:
                raise ValueError(
                    f"layer {layer_idx}: a packed payload of {payload.numel()} bytes; blocks "
                    f"[{block_offset}, {block_end}) of tokens up to {token_end} take {num_bytes}"
                )
            manifests.append(self._manifest(layer_idx, block_offset, block_end, token_end))
        sources: list[Source] = []
        for layer_idx, payload in layers:
            self._layer_token_end[layer_idx] = token_end
            if self._transport.buffer_device(payload.device) == payload.device:
                sources.append(payload)
            else:
                sources.append(lambda out, payload=payload: out.copy_(payload))
        await self._send_layers(manifests, sources, layers[0][1].device)

    async def send_first_token(
        self,
        token_id: int,
        logprob: generation_pb2.TokenLogprob | None = None,
        finish_reason: str = "",
    ) -> None:
        """Send the sampled first token, after every layer's KV: once every layer's message is
        handed to the transport (which delivers in that order), not once it is sent. A no-op
        once finished."""
        if self.finished:
            return
        if self._first_token_sent:
            raise ValueError(f"transfer {self.transfer_id}: the first token was already sent")
        missing = [i for i, end in enumerate(self._layer_token_end) if end != self.num_tokens]
        if missing:
            raise ValueError(
                f"transfer {self.transfer_id}: send every layer's KV of all {self.num_tokens} "
                f"tokens before the first token; layers {missing[:8]} are incomplete"
            )
        self._first_token_sent = True
        if self._unsubmitted:
            await asyncio.wait(set(self._unsubmitted), timeout=self.remaining_s)
        if not self.finished:
            first_token = transfer_pb2.FirstToken(
                token_id=token_id, logprob=logprob, finish_reason=finish_reason
            )
            await self._send(first_token=first_token)

    def complete(self, peer_id: str, msg: TransferMessage, payload: torch.Tensor | None) -> None:
        """A header-only message from the receiver: the handshake's ack or the result (the
        manager refuses payloads for senders before they land)."""
        reason = self._check_envelope(msg)
        if reason is not None:
            self.fail(f"refused a message from {peer_id}: {reason}")
        elif kind_of(msg) == "handshake_ack":
            self._on_ack(msg.handshake_ack)
        elif not msg.result.ok:
            self.fail(f"the receiver failed the transfer: {msg.result.error}", notify_peer=False)
        elif not self._first_token_sent:
            self.fail("refused a success result before the first token was sent")
        else:
            self._succeed()

    def _check_ticket(self, ticket: node_pb2.TransferTicket) -> str | None:
        if not ticket.dst_address:
            return "no dst_address"
        if ticket.layout_hash != self.layout.layout_hash():
            return f"layout_hash {ticket.layout_hash!r} differs from this node's {self.layout}"
        if ticket.num_tokens <= 0:
            return f"num_tokens is {ticket.num_tokens}; a transfer needs at least one token"
        if len(ticket.dst_block_ids) < self.num_blocks:
            return f"{len(ticket.dst_block_ids)} dst blocks for {self.num_blocks} blocks of KV"
        return None

    def _layer_span(self, layer_idx: int, token_end: int) -> tuple[int, int]:
        """The (first, end) block indices of a layer's tokens [previous end, token_end)."""
        if not 0 <= layer_idx < self.layout.num_layers:
            raise ValueError(f"layer_idx {layer_idx} outside [0, {self.layout.num_layers})")
        prev_end = self._layer_token_end[layer_idx]
        if not prev_end < token_end <= self.num_tokens:
            raise ValueError(
                f"layer {layer_idx}: token_end must be in ({prev_end}, {self.num_tokens}] "
                f"(tokens already sent, prompt length), got {token_end}"
            )
        return prev_end // self.layout.block_size, self.layout.num_blocks_for(token_end)

    def _manifest(
        self, layer_idx: int, block_offset: int, block_end: int, token_end: int
    ) -> transfer_pb2.LayerManifest:
        num_blocks = block_end - block_offset
        return transfer_pb2.LayerManifest(
            layer_idx=layer_idx,
            block_offset=block_offset,
            num_blocks=num_blocks,
            num_bytes=self.layout.layer_bytes(num_blocks),
            token_end=token_end,
        )

    async def _send_layer(
        self,
        manifest: transfer_pb2.LayerManifest,
        source: Source,
        device: torch.device,
    ) -> None:
        await self._send_layers([manifest], [source], device)

    async def _send_layers(
        self,
        manifests: list[transfer_pb2.LayerManifest],
        sources: list[Source] | None,
        device: torch.device,
    ) -> None:
        """Once acked, send layers as one message: each source is the payload itself, or
        fills staging with it (None: written in place already)."""
        if self.finished:
            return
        submitted = self._loop.create_future()
        self._unsubmitted.add(submitted)
        try:
            if not await self._wait_acked():
                return
            if self._writer is not None and device == self._writer.device:
                await self._write_in_place(manifests, sources, submitted)
                return
            assert sources is not None
            staging_device = self._transport.buffer_device(device)
            staged: list[torch.Tensor] = []
            sent = False
            try:
                payloads = []
                for manifest, source in zip(manifests, sources, strict=True):
                    if isinstance(source, torch.Tensor):
                        payloads.append(source)
                        continue
                    staged.append(self._staging.take(manifest.num_bytes, staging_device))
                    source(staged[-1])
                    payloads.append(staged[-1])
                sent = await self._send_payloads(manifests, payloads, submitted)
            finally:
                for packed in staged:
                    if sent:
                        self._staging.give_back(packed)
                    else:  # the transport may still be reading it
                        self._staging.discard(packed)
        finally:
            self._unsubmitted.discard(submitted)
            if not submitted.done():  # nothing was sent (finished, refused, a failed write)
                submitted.set_result(None)

    async def _send_payloads(
        self,
        manifests: list[transfer_pb2.LayerManifest],
        payloads: list[torch.Tensor],
        submitted: asyncio.Future[None],
    ) -> bool:
        self._advance(TransferState.TRANSFERRING)
        messages = [(p, {"layer_manifest": m}) for m, p in zip(manifests, payloads, strict=True)]
        # counted as handed over: the receiver may confirm them before their send completes
        self.num_bytes_sent += sum(m.num_bytes for m in manifests)
        return await self._send_all(messages, submitted)

    async def _handshake(self) -> None:
        handshake = transfer_pb2.TransferHandshake(
            protocol_version=PROTOCOL_VERSION,
            layout_hash=self.layout.layout_hash(),
            src_address=self._transport.address,
            num_layers=self.layout.num_layers,
            num_tokens=self.num_tokens,
            num_blocks=self.num_blocks,
            kv_device=self._kv_device,
            write_in_place=self.may_write_in_place,
            timeout_s=self.timeout_s,
        )
        if self._auth is not None:
            handshake.proof = handshake_proof(self._auth, self._ticket, handshake.src_address)
        await self._send(handshake=handshake)

    async def _wait_acked(self) -> bool:
        """True once the receiver accepted the handshake; False if the session ended first."""
        if not self._handshake_resolved.is_set():
            try:
                await asyncio.wait_for(self._handshake_resolved.wait(), self.remaining_s)
            except TimeoutError:
                self.fail("no handshake ack before the deadline")
        return not self.finished

    def _on_ack(self, ack: transfer_pb2.HandshakeAck) -> None:
        if self._handshake_resolved.is_set():
            self.fail("refused a second handshake ack")
        elif not ack.accepted:
            self.fail(f"the receiver refused the handshake: {ack.reason}", notify_peer=False)
        else:
            if ack.HasField("pool"):
                self._map_pool(ack.pool)
            self._advance(TransferState.WAITING)
            self._handshake_resolved.set()
