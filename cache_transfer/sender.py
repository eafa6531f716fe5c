"""`KVSender`: the prefill side of one KV hand-off.

    created from the ticket ── hello (at once: queued or computing) ... challenge (SenderHello)
        ── handshake (proving the challenge's nonce, with a cluster secret) ──► BOOTSTRAPPING
        ── ack ──► WAITING
    beat(n) while the node's engine progresses (queued, or computing this prompt): a Progress
    message (MACed as any other) when nothing else went out for a while (SenderBeats)
    start() when the engine starts this prefill (marks elapsed_s)
    send_layer(i, k, v, ...) / send_layers([(i, k, v), ...]) as layers' KV is written (any
    layer order; chunks in token order), or send_packed(i, payload) / send_packed_layers(...)
    for layers the caller packed (several layers: one message)
        ──► TRANSFERRING ── send_first_token() (behind them: SendOrder) ── result ok ──► SUCCESS
    refused handshake, no progress for timeout_s, the ceiling, a transport error, abort() /
    cancel(), or a failed result ──► FAILED

Layers wait for the handshake's ack before they are packed (a refused layout costs no
bandwidth; `LayerSpans` makes their manifests). Writes in place: a receiver on our GPU that
grants it gets each layer written into its blocks by us, then a manifest without payload
(`InPlaceWrites`). The node releases the request's blocks once `wait()` returns.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import torch

from cache_transfer.finished_receivers import ALREADY_ENDED
from cache_transfer.frame_auth.sender_hello import SenderHello
from cache_transfer.in_place.pool_sharing import PoolSharing
from cache_transfer.in_place.sender_writes import InPlaceWrites
from cache_transfer.in_place.writer import InPlaceWriter
from cache_transfer.layer_spans import CacheLayers, LayerSpans
from cache_transfer.layout import HeadSlice, KVLayout
from cache_transfer.packing.packed_layer import LayerSource
from cache_transfer.packing.staging_pool import StagedSend, StagingPool
from cache_transfer.protocol import TransferMessage, kind_of
from cache_transfer.route_slice import RouteSlice
from cache_transfer.send_order import SendOrder
from cache_transfer.sender_beats import SenderBeats
from cache_transfer.session import Outgoing, TransferSession
from cache_transfer.state import TransferState
from cache_transfer.tickets import check_ticket, ticket_misfit, ticket_suffix
from cache_transfer.transports.base import KVTransport
from pdserve.security import ClusterAuth
from pdserve.v1 import generation_pb2, node_pb2, transfer_pb2


class KVSender(TransferSession):
    role = "sender"

    def __init__(
        self,
        transport: KVTransport,
        staging: StagingPool,
        layout: KVLayout,
        ticket: node_pb2.TransferTicket,
        timeout_s: float,
        auth: ClusterAuth | None = None,
        ceiling_s: float | None = None,
        sharing: PoolSharing | None = None,
        kv_device: str = "",
        device: torch.device | None = None,
        encrypt: bool = False,
        log_id: str = "",
        route: RouteSlice | None = None,
    ) -> None:
        """`timeout_s`, `ceiling_s`, `log_id`: a TransferSession's. `sharing`, `kv_device`,
        `device`: write in place (see above). `auth`: a forged ticket fails at once, nobody
        contacted; the handshake proves the secret (`encrypt`: --kv-encrypt). `route`: one
        route of a TP hand-off (cache_transfer/tp/): its heads, maybe no first token."""
        super().__init__(transport, ticket.transfer_id, timeout_s, ceiling_s, log_id)
        self._hello = SenderHello(transport, auth, ticket, self.frames, encrypt)
        self.add_finish_callback(lambda _: self._hello.session_ended())
        self.frames.required = auth is not None
        self._ticket, self.layout, self.num_tokens = ticket, layout, ticket.num_tokens
        self.suffix = ticket_suffix(layout, ticket)  # what the receiver lacks: KVSuffix
        self.num_blocks = self.suffix.num_blocks  # per layer
        self.num_bytes_skipped = layout.kv_bytes(self.suffix.num_cached_blocks)  # D holds them
        self.heads = route.heads if route else HeadSlice.whole(layout.num_kv_heads)
        self.sends_first_token = route is None or route.first_token  # else done with its layers
        self.num_bytes_sent, self._peer_address = 0, ticket.dst_address or None  # bytes handed on
        self._spans = LayerSpans(layout, self.suffix)
        self._first_token_sent, self._staging = False, staging
        self._beats = SenderBeats(self._loop, timeout_s)
        self._order = SendOrder(self._loop)  # the first token right behind the layers
        self._in_place = InPlaceWrites(sharing, kv_device, device, ticket, self.num_blocks)
        forged = check_ticket(auth, ticket) if auth is not None else None
        reason = ticket_misfit(layout, ticket)
        if forged is not None:
            self.fail(f"refused the ticket: {forged}", notify_peer=False)
        elif reason is not None:
            self.fail(f"refused the ticket: {reason}")
        else:
            self.spawn(self._open())

    @property
    def dst_kv_device(self) -> str:
        """The device the receiver's KV cache lives on, as its ticket names it ("" unknown)."""
        return self._ticket.kv_device

    @property
    def may_write_in_place(self) -> bool:
        """Whether the handshake asks to write in place (the receiver is on our GPU)."""
        return self._in_place.asks

    @property
    def in_place(self) -> bool:
        """Whether the receiver granted writes in place."""
        return self._in_place.granted

    @property
    def in_place_writer(self) -> InPlaceWriter | None:
        """Granted and mapped: what writes layers into the receiver's blocks (any thread)."""
        return self._in_place.writer

    def beat(self, num_computed_tokens: int) -> None:
        """This node's engine progressed (`num_computed_tokens` of this prompt computed; 0:
        queued): tell the receiver when due (SenderBeats), from the ack to the first token."""
        busy = self.finished or self.state < TransferState.WAITING or self._first_token_sent
        if not busy and self._beats.due():
            self.spawn(self._send_progress(num_computed_tokens))

    async def _send_progress(self, computed: int) -> None:
        if not self.finished and not self._first_token_sent:  # numbered before the token
            await self._send(progress=transfer_pb2.Progress(num_computed_tokens=computed))

    def _on_sending(self) -> None:
        self._beats.sent()
        self.touch()

    async def send_layer(
        self,
        layer_idx: int,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        src_block_ids: Sequence[int],
        token_end: int | None = None,
    ) -> None:
        """Send layer `layer_idx`'s KV of the prompt up to `token_end` (default: all of it):
        the blocks of the request's block table `src_block_ids` not yet sent for this layer
        (a chunked prefill calls this once per chunk). A no-op once finished."""
        await self.send_layers([(layer_idx, k_cache, v_cache)], src_block_ids, token_end)

    async def send_layers(
        self, layers: CacheLayers, src_block_ids: Sequence[int], token_end: int | None = None
    ) -> None:
        """`send_layer` for several `(layer_idx, k_cache, v_cache)` (distinct layers, caches on
        one device) as one message: packed into staging and sent, or, in place, copied block to
        block into the receiver's blocks, one header. ValueError, nothing sent, if any is wrong."""
        token_end = self.num_tokens if token_end is None else token_end
        manifests, sources = self._spans.from_caches(layers, src_block_ids, token_end)
        await self._send_layers(manifests, sources, layers[0][1].device)

    async def send_packed(
        self, layer_idx: int, payload: torch.Tensor, token_end: int | None = None
    ) -> None:
        """Send layer `layer_idx`'s KV packed already (by `pack_layer`): the request's blocks
        not yet sent for this layer up to `ceil(token_end / block_size)`, in order, as flat
        uint8. Sent in place when it lives where the transport sends from (`buffer_device`),
        else copied once into staging; leave it unchanged until this returns. A CUDA payload
        must be written on the current stream. No-op once finished."""
        await self.send_packed_layers([(layer_idx, payload)], token_end)

    async def send_packed_layers(
        self, layers: Sequence[tuple[int, torch.Tensor]], token_end: int | None = None
    ) -> None:
        """`send_packed` for several layers (distinct, same `token_end`) as one transport
        message (`send_many`): the receiver lands and reports each layer as if sent alone.
        ValueError, nothing sent, when any is wrong."""
        token_end = self.num_tokens if token_end is None else token_end
        buffer_device = self._transport.buffer_device
        manifests, sources = self._spans.from_packed(layers, token_end, buffer_device)
        await self._send_layers(manifests, sources, layers[0][1].device)

    async def send_written_layers(
        self, layer_ids: Sequence[int], token_end: int | None = None
    ) -> None:
        """Layers the caller wrote through `in_place_writer` (writes complete): tell the
        receiver, one message. ValueError, nothing sent, when any is wrong."""
        writer = self._in_place.writer
        if writer is None:
            raise ValueError(f"transfer {self.transfer_id}: no writes in place were granted")
        token_end = self.num_tokens if token_end is None else token_end
        manifests = self._spans.written(layer_ids, token_end)
        await self._send_layers(manifests, None, writer.device)

    async def send_first_token(
        self,
        token_id: int,
        logprob: generation_pb2.TokenLogprob | None = None,
        finish_reason: str = "",
        draft_token_ids: Sequence[int] = (),
    ) -> None:
        """Send the sampled first token (and its drafts) once every layer's message is handed
        to the transport (which delivers in order), not once sent. A no-op once finished."""
        if self.finished:
            return
        if self._first_token_sent:
            raise ValueError(f"transfer {self.transfer_id}: the first token was already sent")
        self._spans.check_complete(f"transfer {self.transfer_id}")
        self._first_token_sent = True
        await self._order.behind_layers(self.remaining_s)
        if not self.finished:
            first_token = transfer_pb2.FirstToken(token_id=token_id, logprob=logprob,
                finish_reason=finish_reason, draft_token_ids=draft_token_ids)  # fmt: skip
            # sealed whole (drafts included) when encrypted; the frame's MAC covers it all
            await self._send(first_token=self.frames.seal_token(first_token))

    def complete(self, peer_id: str, msg: TransferMessage, _: object, header: bytes = b"") -> None:
        """A header-only message from the receiver (its bytes: `header`): the challenge, the
        ack or the result (the manager refuses payloads for senders). With a cluster secret
        every one after the challenge carries its MAC."""
        if kind_of(msg) == "challenge":  # ours binds our FrameKey (SenderHello)
            refused = self._hello.take(peer_id, msg.challenge)
            if refused is not None:
                self._refused("the transfer", refused)
            return
        reason = self.frames.forged(msg, header) or self._check_envelope(msg)
        if reason is not None:
            self.fail(f"refused a message from {peer_id}: {reason}")
        elif kind_of(msg) == "handshake_ack":
            self._on_ack(msg.handshake_ack)
        elif not msg.result.ok:  # (the receiver logged why)
            self.fail(f"the receiver failed the transfer: {msg.result.error}", notify_peer=False,
                      level=logging.INFO)  # fmt: skip
        elif self.sends_first_token and not self._first_token_sent:
            self.fail("refused a success result before the first token was sent")
        elif not self._spans.is_complete():  # (a route that ends with its layers)
            self.fail("refused a success result before every layer was sent")
        else:
            self._succeed()

    def fail(self, reason: str, *, notify_peer: bool = True, level: int = logging.WARNING) -> None:
        """As any session; granted writes in place, the receiver hears only once every write
        this sender launched is done (writes_drained), whoever ended the transfer."""
        drains = self._in_place.granted and not self.finished
        super().fail(reason, notify_peer=notify_peer and not drains, level=level)
        if drains and self._peer_address is not None:
            self.spawn(self._drain_then_notify(reason))

    async def _drain_then_notify(self, reason: str) -> None:
        result = await self._in_place.drained_notice(reason)  # (None: D keeps its blocks)
        if result is not None:
            await self._notify(result=result)

    async def _send_layers(
        self,
        manifests: list[transfer_pb2.LayerManifest],
        sources: Sequence[LayerSource] | None,
        device: torch.device,
    ) -> None:
        """Once acked, hand layers over as one message: written in place (maybe already), or sent."""
        if self.finished:
            return
        submitted = self._order.begin()
        try:
            if not await self._wait_acked():
                return
            if self._in_place.writes_to(device):
                await self._write_in_place(manifests, sources, submitted)
            else:
                assert sources is not None
                await self._send_payloads(manifests, sources, device, submitted)
        finally:
            self._order.end(submitted)

    async def _send_payloads(
        self,
        manifests: list[transfer_pb2.LayerManifest],
        sources: Sequence[LayerSource],
        device: torch.device,
        submitted: asyncio.Future[None],
    ) -> None:
        """Each layer with its payload: the source itself, or staging it fills."""
        staged = StagedSend(self._staging, self._transport.buffer_device(device))
        sent = False
        try:
            messages: list[Outgoing] = [
                (self.frames.payload(staged, manifest, source), {"layer_manifest": manifest})
                for manifest, source in zip(manifests, sources, strict=True)
            ]
            self._advance(TransferState.TRANSFERRING)
            # counted as handed over: the receiver may confirm them before their send completes
            self.num_bytes_sent += sum(m.num_bytes for m in manifests)
            sent = await self._send_all(messages, submitted)
        finally:
            staged.release(sent)

    async def _write_in_place(
        self,
        manifests: list[transfer_pb2.LayerManifest],
        sources: Sequence[LayerSource] | None,
        submitted: asyncio.Future[None],
    ) -> None:
        """Land the layers in the receiver's blocks ourselves (`sources` None: the caller did,
        through `in_place_writer`), then tell it in one message (header only: a manifest per
        token span, naming its layers)."""
        self._advance(TransferState.TRANSFERRING)
        announced = await self._in_place.land(manifests, sources, self.remaining_s)
        if isinstance(announced, str):
            self.fail(announced)
            return
        self.num_bytes_sent += sum(m.num_bytes for m in manifests)  # as in _send_payloads
        await self._send_all([(None, {"layer_manifest": m}) for m in announced], submitted)

    def _refused(self, what: str, reason: str) -> None:
        """The receiver refused us (INFO when it had ended already: it logged why)."""
        level = logging.INFO if reason.startswith(ALREADY_ENDED) else logging.WARNING
        self.fail(f"the receiver refused {what}: {reason}", notify_peer=False, level=level)

    async def _open(self) -> None:
        """The hello at once (an unreachable receiver fails the transfer now), then, once
        challenged, the handshake, proving the challenge's nonce on our connection."""
        failed = await self._hello.open(
            self._ticket.dst_address, self.timeout_s, lambda: self.remaining_s
        )
        if failed is not None:
            self.fail(failed[0], notify_peer=failed[1])
        if not self.finished:
            kv_device, asks = self._in_place.kv_device, self.may_write_in_place
            await self._send(handshake=self._hello.handshake(self.layout, kv_device, asks,
                                                             self.remaining_s, self.heads))  # fmt: skip

    async def _wait_acked(self) -> bool:
        """True once the receiver accepted the handshake; False if the session ended first."""
        if not await self._hello.wait(self._hello.acked, self.remaining_s):
            self.fail("no handshake ack before the deadline")
        return not self.finished

    def _on_ack(self, ack: transfer_pb2.HandshakeAck) -> None:
        if self._hello.acked.is_set():
            self.fail("refused a second handshake ack")
        elif not ack.accepted:
            self._refused("the handshake", ack.reason)
        else:
            refused = self._in_place.take_grant(ack.pool) if ack.HasField("pool") else None
            if refused is not None:
                self.fail(refused)
                return
            self.touch()
            self._advance(TransferState.WAITING)
            self._hello.acked.set()
