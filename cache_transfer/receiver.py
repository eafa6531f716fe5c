"""`KVReceiver`: the decode side of one KV hand-off.

    created (blocks reserved) ── ticket() ──► router ──► prefill node
    hello from a connection ──► challenge {a fresh nonce for it} (any number of connections,
                                at most MAX_OUTSTANDING waiting at once; nothing starts)
    BOOTSTRAPPING ── handshake ok (the ceiling: the sender's, up to max_ceiling_s) ──► WAITING
                  ── progress ... (P queued or computing: the no-progress timer starts over;
                     the first with computed tokens marks the start)
                  ── layer lands ──► TRANSFERRING
                  ── every layer complete + first token ──► SUCCESS (result ok sent to P)
    any refused message, no progress for timeout_s, the ceiling, P's failed result, or a lost
    connection mid-layer ──► FAILED (blocks untouched since; freed once wait() returns)
    add_layer_callback(cb): cb(layer_idx, token_end) as each layer lands (traces, metrics)

Every message is checked before its payload lands (receiver_checks.py: every check, in the
order they run); payloads land only in this session's own `dst_block_ids` (`LayerLanding`,
which the receiver owns: staging, the payload's MAC, the unpack). With a cluster
secret only the sender whose handshake proved its connection's challenge is heard, and each of
its messages only if its MAC verifies (a payload's once it landed in staging, before it is
unpacked; a GPU payload's through its device digest, off the event loop). A sender on this
GPU may be granted writes in place (`InPlaceGrant`: `writes_settled` says when the blocks may
be reused). A retried sender may take a waiting session over (`takeover_allowed`): the layers
start over (the same blocks, overwritten), the first sender is heard no more, and the
ceiling stays the first handshake's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from cache_transfer import receiver_checks as checks
from cache_transfer.frame_auth.challenges import Challenges
from cache_transfer.frame_auth.frame_key import TO_SENDER, FrameKey
from cache_transfer.in_place.receiver_grant import InPlaceGrant
from cache_transfer.layer_landing import LayerLanding
from cache_transfer.layout import HeadSlice, KVCaches, KVLayout, check_reservation, kv_device_id
from cache_transfer.packing.staging_pool import StagingPool
from cache_transfer.protocol import PROTOCOL_VERSION, TransferMessage, kind_of
from cache_transfer.route_slice import ReceiverRoute
from cache_transfer.session import TransferSession
from cache_transfer.state import TransferState
from cache_transfer.suffix import KVSuffix
from cache_transfer.tickets import issue_ticket
from cache_transfer.transports.base import KVTransport
from pdserve.security import ClusterAuth
from pdserve.v1 import node_pb2, transfer_pb2

logger = logging.getLogger(__name__)

LayerCallback = Callable[[int, int], None]  # (layer_idx, token_end) of a layer that landed


class KVReceiver(TransferSession):
    role = "receiver"
    outgoing = TO_SENDER

    def __init__(
        self,
        transport: KVTransport,
        staging: StagingPool,
        layout: KVLayout,
        kv_caches: KVCaches,
        transfer_id: str,
        dst_block_ids: Sequence[int],
        num_tokens: int,
        timeout_s: float,
        auth: ClusterAuth | None = None,
        max_ceiling_s: float | None = None,
        pool_export: transfer_pb2.KVPoolExport | None = None,
        kv_device: str | None = None,
        require_encryption: bool = False,
        log_id: str = "",
        num_cached_blocks: int = 0,
        route: ReceiverRoute | None = None,
    ) -> None:
        """`dst_block_ids`: after the prompt's `num_cached_blocks` held (`KVSuffix`; a `route`'s:
        its ticket's, tp/); `pool_export`: in place on `kv_device`; `auth`: signed, proven."""
        num_cached_blocks = route.ticket.num_cached_blocks if route else num_cached_blocks
        self.suffix = KVSuffix(layout.block_size, num_tokens, num_cached_blocks)
        check_reservation(kv_caches[0][0].shape[0], dst_block_ids, self.suffix)
        self.max_ceiling_s = timeout_s if max_ceiling_s is None else max_ceiling_s
        super().__init__(transport, transfer_id, timeout_s, self.max_ceiling_s, log_id)
        self.layout, self.dst_block_ids, self.num_tokens = layout, list(dst_block_ids), num_tokens
        self.num_blocks = self.suffix.num_blocks  # blocks per layer the KV fills
        self.first_token: transfer_pb2.FirstToken | None = None
        self.num_computed_tokens = self.num_bytes_received = 0  # computed: as P last said
        self.num_bytes_skipped = layout.kv_bytes(num_cached_blocks)  # the prompt's, held here
        self.layer_token_end = [self.suffix.cached_tokens] * layout.num_layers  # accepted so far
        self.sender_id: str | None = None  # the peer that handshook
        self.superseded: set[str] = set()  # senders a takeover replaced: heard no more
        self._auth = auth
        buffers = transport.buffer_device(kv_caches[0][0].device)  # where payloads land
        self._landing = LayerLanding(self, self.frames, staging, kv_caches, dst_block_ids, buffers)
        self._layer_callbacks: list[LayerCallback] = []
        self.authenticated, self.requires_encryption = auth is not None, require_encryption
        self.challenges = Challenges()  # the nonce of each connection that said hello
        self._proven_key: FrameKey | None = None  # that of the handshake being heard
        kv_device = kv_device_id(kv_caches[0][0].device) if kv_device is None else kv_device
        self.route, self._ticket = route, route.ticket if route else issue_ticket(
            auth, timeout_s, transfer_id, transport.address, self.dst_block_ids,
            layout.layout_hash(), num_tokens, kv_device, num_cached_blocks,
            layout.dtype)  # fmt: skip
        self._in_place = InPlaceGrant(transfer_id, pool_export, kv_device, log_id)
        self.writes_settled = self._in_place.writes_settled  # no write can land: blocks free
        self.add_finish_callback(lambda _: self._in_place.on_finished(self.state))

    @property
    def heads(self) -> HeadSlice:
        """What the sender's handshake must say it carries."""
        return self.route.heads if self.route else HeadSlice.whole(self.layout.num_kv_heads)

    @property
    def expects_first_token(self) -> bool:
        """False: a TP route that ends with its layers (the first token comes on another)."""
        return self.route is None or self.route.first_token

    @property
    def num_landing(self) -> int:
        """Payloads prepare() accepted whose bytes have not landed yet."""
        return self._landing.num_landing

    @property
    def in_place(self) -> bool:
        """Whether the sender was granted writes in place."""
        return self._in_place.granted

    def add_layer_callback(self, callback: LayerCallback) -> None:
        """Call `callback(layer_idx, token_end)` each time a layer's KV has been written into
        this session's blocks (once per layer manifest; errors are logged, not raised)."""
        self._layer_callbacks.append(callback)

    def ticket(self) -> node_pb2.TransferTicket:
        """What the prefill node needs to send this session its KV (signed, with a secret)."""
        return node_pb2.TransferTicket.FromString(self._ticket.SerializeToString())  # a copy

    def prepare(
        self, peer_id: str, msg: TransferMessage, payload_bytes: int
    ) -> torch.Tensor | None:
        """A message with a payload: accept a valid layer and hand out its staging buffer (its
        MAC, which covers the payload, is checked once it landed there)."""
        if not self._hears(peer_id, msg, None):
            return None
        refusal = checks.refusal(self, peer_id, msg, payload_bytes)
        if refusal is not None:
            self.fail(refusal.error)
            return None
        self._recv_seq += 1
        self.touch()
        manifest = msg.layer_manifest
        self.layer_token_end[manifest.layer_idx] = manifest.token_end
        return self._landing.take(payload_bytes)

    def complete(
        self,
        peer_id: str,
        msg: TransferMessage,
        payload: torch.Tensor | None,
        header: bytes = b"",
    ) -> None:
        """A whole message (its bytes: `header`): land a layer prepare() accepted once its MAC
        verifies, or act on a header-only one."""
        if payload is not None:
            self._landing.land(msg, header, payload)
            return
        kind = kind_of(msg)
        if kind == "hello":  # a challenge for its connection (to its src_address)
            answer = self.challenges.answer(peer_id, msg.hello, self._auth, self.transfer_id)
            if answer is not None:
                self.spawn(self._send_best_effort(msg.hello.src_address, answer))
            return
        if not self._hears(peer_id, msg, header):
            return
        if self.finished and kind == "result" and msg.result.writes_drained:
            self._in_place.on_drained(peer_id, self.sender_id)
            return
        if checks.takeover_allowed(self, peer_id, msg):
            self._drop_sender(peer_id)
        refusal = checks.refusal(self, peer_id, msg, None)
        if refusal is None:
            self._recv_seq += 1
            self.touch()
        if kind == "handshake" and (refusal is None or refusal.of_handshake):
            self._on_handshake(peer_id, msg.handshake, refusal)
        elif refusal is not None:
            self.fail(refusal.error)
        else:
            self._act_on(peer_id, msg)

    def abandon(self, peer_id: str, msg: TransferMessage, payload: torch.Tensor) -> None:
        """A layer prepare() accepted will never land: its connection broke mid-way."""
        self._landing.abandon(payload)
        layer_idx = msg.layer_manifest.layer_idx
        self.fail(f"the connection from {peer_id} broke while layer {layer_idx} was landing")

    def _hears(self, peer_id: str, msg: TransferMessage, header: bytes | None) -> bool:
        """Checks 1 and 2 (and, with `header`, the MAC): a message nobody but the sender may
        send is dropped (logged); it neither feeds nor fails the session. The sender's own
        message whose MAC fails fails it."""
        unproven = self._unproven(peer_id, msg, header)
        if unproven is not None:
            self.log(logging.WARNING, "receiver %s: ignored a message from %s: %s",
                     self.transfer_id, peer_id, unproven)  # fmt: skip
            return False
        superseded = checks.superseded_sender(self, peer_id, msg)
        if superseded is not None:
            self.log(logging.INFO, "receiver %s: dropped %s", self.transfer_id, superseded)
            return False
        mine = header is not None and peer_id == self.sender_id
        forged = self.frames.forged(msg, header or b"") if mine else None
        if forged is not None:
            self.fail(f"refused a message from {peer_id}: {forged}")
        return forged is None

    def _unproven(self, peer_id: str, msg: TransferMessage, header: bytes | None) -> str | None:
        """Check 1; a handshake that proves its connection's challenge must carry that
        challenge's MAC too (its key: `_proven_key`, bound if the handshake is accepted)."""
        nonce = None
        if kind_of(msg) == "handshake" and peer_id != self.sender_id:
            nonce = self.challenges.take(peer_id)  # one handshake per challenge
        unproven = checks.unproven_sender(self, self._auth, self._ticket, peer_id, msg, nonce)
        if unproven is not None or nonce is None or self._auth is None or self.finished:
            return unproven
        self._proven_key = FrameKey(self._auth, self.transfer_id, nonce, peer_id)
        return self.frames.forged(msg, header or b"", key=self._proven_key)

    def _act_on(self, peer_id: str, msg: TransferMessage) -> None:
        """A header-only message the checks accepted (other than a handshake)."""
        kind = kind_of(msg)
        if kind == "progress":
            self.num_computed_tokens = msg.progress.num_computed_tokens
            if self.num_computed_tokens:
                self.start()
        elif kind == "layer_manifest":
            self._land_in_place(msg.layer_manifest)
        elif kind == "first_token":
            try:
                self.first_token = checks.bounded_drafts(self.frames.open_token(msg.first_token))
            except ValueError as error:
                self.fail(f"refused the first token: {error}")
            self._maybe_succeed()
        else:  # a failed result (a successful one is refused); the sender logged why
            self.fail(f"the sender ended the transfer: {msg.result.error}", notify_peer=False,
                      level=logging.INFO)  # fmt: skip
            if msg.result.writes_drained:
                self._in_place.on_drained(peer_id, self.sender_id)

    def _drop_sender(self, peer_id: str) -> None:
        """Forget the sender `peer_id` replaces: its later messages are dropped, the layers
        received so far will be sent again (the blocks are simply overwritten)."""
        self.log(logging.WARNING, "receiver %s: %s takes over from %s (a prefill retry); the "
                 "layers start over", self.transfer_id, peer_id, self.sender_id)  # fmt: skip
        assert self.sender_id is not None
        self.superseded.add(self.sender_id)
        self.sender_id = None
        self.layer_token_end = [self.suffix.cached_tokens] * self.layout.num_layers
        self.num_computed_tokens = 0
        self._send_seq = self._recv_seq = 0

    def _on_handshake(
        self,
        peer_id: str,
        handshake: transfer_pb2.TransferHandshake,
        refusal: checks.Refusal | None,
    ) -> None:
        """Answer it: refused (the session fails), or accepted (the ceiling is the sender's, up
        to ours; writes in place are granted if asked for from this GPU)."""
        self.sender_id = peer_id
        self._peer_address = handshake.src_address or None
        # its MAC key (None: an open cluster), and its cipher if it encrypts
        self.frames.bind(self._proven_key, handshake.encrypted and refusal is None)
        ack = transfer_pb2.HandshakeAck(accepted=refusal is None, protocol_version=PROTOCOL_VERSION)
        if refusal is not None:
            ack.reason = refusal.reason
            self.fail(refusal.error, notify_peer=False)
            if self._peer_address is not None:
                self.spawn(self._notify(handshake_ack=ack))
            return
        if self.state == TransferState.BOOTSTRAPPING and handshake.timeout_s > 0:
            # the sender's ceiling, up to ours (a takeover's handshake does not move it)
            self.set_ceiling(min(handshake.timeout_s, self.max_ceiling_s))
        self._advance(TransferState.WAITING)
        self._in_place.grant(handshake, ack)
        self.spawn(self._send(handshake_ack=ack))

    def _land_in_place(self, manifest: transfer_pb2.LayerManifest) -> None:
        """Layers the sender wrote into our blocks itself (its writes completed before it
        sent the manifest)."""
        layer_ids = [manifest.layer_idx, *manifest.more_layer_ids]
        for layer_idx in layer_ids:
            self.layer_token_end[layer_idx] = manifest.token_end
        self.on_landed(manifest, layer_ids)

    def on_landed(self, manifest: transfer_pb2.LayerManifest, layer_ids: list[int]) -> None:
        """Layers are in our blocks (unpacked by `LayerLanding`, or written by the sender)."""
        self.num_bytes_received += manifest.num_bytes * len(layer_ids)
        self.start()  # (unless progress said so first)
        self._advance(TransferState.TRANSFERRING)
        for layer_idx in layer_ids:
            for callback in self._layer_callbacks:
                try:
                    callback(layer_idx, manifest.token_end)
                except Exception:
                    logger.exception("receiver %s: a layer callback failed", self.transfer_id)
        self._maybe_succeed()

    def _maybe_succeed(self) -> None:
        whole = min(self.layer_token_end) == self.num_tokens  # (a TP route: no first token)
        complete = self.first_token is not None if self.expects_first_token else whole
        if complete and self.num_landing == 0 and not self.finished:
            self._succeed()
            self.spawn(self._notify(result=transfer_pb2.TransferResult(ok=True)))
