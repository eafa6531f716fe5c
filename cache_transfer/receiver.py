"""`KVReceiver`: the decode side of one KV hand-off.

    created (blocks reserved) ── ticket() ──► router ──► prefill node
    BOOTSTRAPPING ── handshake ok (starts the deadline, given start_timeout_s) ──► WAITING
                  ── layer lands ──► TRANSFERRING
                  ── every layer complete + first token ──► SUCCESS (result ok sent to P)
    any refused message, the deadline, P's failed result, or a connection lost mid-layer
    ──► FAILED (blocks untouched since; the node frees them once wait() returns)
    add_layer_callback(cb): cb(layer_idx, token_end) as each layer lands (traces, metrics)

Writes in place (given `pool_export`, the node's caches as a CUDA IPC export): a sender on
this very GPU that asks (handshake.write_in_place, its kv_device = the ticket's) is granted the
export in the ack and writes each layer into `dst_block_ids` itself; its manifests then carry
written_in_place and no payload, and are checked exactly like payloads. Such a sender may still
be writing when the session fails, so `writes_settled` is set only once it says it drained
(TransferResult.writes_drained), or once its own deadline (handshake.timeout_s, from before the
handshake) is past by QUARANTINE_MARGIN_S: the node reuses the blocks only then.

Every message is checked against the ticket before its payload lands: the peer that
handshook, the sequence number, the layer index, the exact token span and block range, the
byte count. Payloads are scattered only into this session's own `dst_block_ids`.

Takeover (the router's retry of a prefill node that died after it handshook): a valid handshake
from another sender (with a cluster secret: one proving it) replaces the first one while no
layer of the first is landing, none was written in place and no first token came. The layers
start over from the new sender (the same blocks, overwritten), the first sender's later
messages are dropped, and the deadline stays the first handshake's.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

import torch

from cache_transfer.layout import KVLayout, check_reservation, kv_device_id
from cache_transfer.manifest_checks import (
    handshake_refusal,
    layer_refusal,
    written_layers_refusal,
)
from cache_transfer.packing import CheckedIds, check_block_ids, unpack_layer
from cache_transfer.protocol import PROTOCOL_VERSION, TransferMessage, kind_of
from cache_transfer.session import TransferSession
from cache_transfer.staging_pool import StagingPool
from cache_transfer.state import TransferState
from cache_transfer.ticket_auth import check_handshake, sign_ticket
from cache_transfer.transports.base import KVTransport
from pdserve.security import ClusterAuth
from pdserve.v1 import node_pb2, transfer_pb2

logger = logging.getLogger(__name__)

KVCaches = Sequence[tuple[torch.Tensor, torch.Tensor]]  # per layer: (k_cache, v_cache)
LayerCallback = Callable[[int, int], None]  # (layer_idx, token_end) of a layer that landed
# After a failed transfer written in place: how long past the sender's own deadline its last
# launched write may still land (the deadline stops new writes; one kernel takes microseconds).
QUARANTINE_MARGIN_S = 2.0


class KVReceiver(TransferSession):
    role = "receiver"

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
        start_timeout_s: float | None = None,
        pool_export: transfer_pb2.KVPoolExport | None = None,
        kv_device: str | None = None,
    ) -> None:
        """`pool_export`: grant writes in place to a sender on `kv_device` (default: the
        caches' device, kv_device_id) that asks. `dst_block_ids`: every block reserved for the request (the first
        ceil(num_tokens / block_size) receive the KV); `num_tokens`: prompt tokens to receive.
        With `auth` the ticket is signed and only a handshake proving the cluster secret is
        heard (any other is ignored and logged: it neither feeds nor fails the session).
        With `start_timeout_s` the sender's handshake must come within it, and `timeout_s`
        counts from the handshake (the sender starts when its prefill does)."""
        check_reservation(layout, kv_caches[0][0].shape[0], dst_block_ids, num_tokens)
        super().__init__(transport, transfer_id, timeout_s, start_timeout_s)
        self.layout = layout
        self.dst_block_ids = list(dst_block_ids)
        self.num_tokens = num_tokens
        self.num_blocks = layout.num_blocks_for(num_tokens)
        self.first_token: transfer_pb2.FirstToken | None = None
        self.num_bytes_received = 0
        self._kv_caches = kv_caches
        self._layer_token_end = [0] * layout.num_layers  # tokens of each layer accepted so far
        self._num_landing = 0  # payloads accepted by prepare() whose bytes have not landed yet
        self._peer_id: str | None = None
        self._superseded: set[str] = set()  # senders a takeover replaced: heard no more
        self._staging = staging
        self._device = transport.buffer_device(kv_caches[0][0].device)
        self._layer_callbacks: list[LayerCallback] = []
        self._auth = auth
        self._ticket = node_pb2.TransferTicket(
            transfer_id=self.transfer_id,
            dst_address=self._transport.address,
            dst_block_ids=self.dst_block_ids,
            layout_hash=self.layout.layout_hash(),
            num_tokens=self.num_tokens,
            kv_device=kv_device_id(kv_caches[0][0].device) if kv_device is None else kv_device,
        )
        self._pool_export = pool_export
        self.in_place = False  # the sender was granted writes in place
        self.writes_settled = asyncio.Event()  # no write of the sender can land any more
        self.writes_settled.set()  # (until a grant)
        self._quarantine_timer: asyncio.TimerHandle | None = None
        self.add_finish_callback(lambda _: self._on_finished())
        if auth is not None:
            sign_ticket(auth, self._ticket, timeout_s)
        self._dst_ids: CheckedIds | None = None  # dst_block_ids on the cache's device, once

    def add_layer_callback(self, callback: LayerCallback) -> None:
        """Call `callback(layer_idx, token_end)` each time a layer's KV has been written into
        this session's blocks (once per layer manifest; errors are logged, not raised)."""
        self._layer_callbacks.append(callback)

    def ticket(self) -> node_pb2.TransferTicket:
        """What the prefill node needs to send this session its KV (signed, with a secret)."""
        ticket = node_pb2.TransferTicket()
        ticket.CopyFrom(self._ticket)
        return ticket

    def prepare(
        self, peer_id: str, msg: TransferMessage, payload_bytes: int
    ) -> torch.Tensor | None:
        """A message with a payload: accept a valid layer and hand out its staging buffer."""
        if self._ignored(peer_id, msg) or self._from_superseded(peer_id, msg):
            return None
        reason = self._check_sender(peer_id, msg)
        if reason is None:
            if kind_of(msg) != "layer_manifest":
                reason = f"a {kind_of(msg)} message must not carry a payload"
            elif msg.layer_manifest.written_in_place or msg.layer_manifest.more_layer_ids:
                reason = "a layer written in place must not carry a payload"
            else:
                reason = layer_refusal(*self._layer_state(), msg.layer_manifest, payload_bytes)
        if reason is not None:
            self.fail(f"refused a message from {peer_id}: {reason}")
            return None
        manifest = msg.layer_manifest
        self._layer_token_end[manifest.layer_idx] = manifest.token_end
        self._num_landing += 1
        return self._staging.take(payload_bytes, self._device)

    def complete(self, peer_id: str, msg: TransferMessage, payload: torch.Tensor | None) -> None:
        """A whole message: land a layer prepare() accepted, or handle a header-only message."""
        kind = kind_of(msg)
        if payload is not None:
            self._land_layer(msg.layer_manifest, payload)
            return
        if self._ignored(peer_id, msg) or self._from_superseded(peer_id, msg):
            return
        if self.finished and kind == "result" and msg.result.writes_drained:
            self._on_writes_drained(peer_id)
            return
        if self._may_take_over(peer_id, msg):
            self._drop_sender(peer_id)
        reason = self._check_sender(peer_id, msg)
        if reason is None and kind == "layer_manifest":
            manifest = msg.layer_manifest
            if not manifest.written_in_place:
                reason = "a layer manifest without its payload"
            elif not self.in_place:
                reason = "a layer written in place, which this receiver did not grant"
            else:
                reason = written_layers_refusal(*self._layer_state(), manifest)
        if reason is not None:
            self.fail(f"refused a message from {peer_id}: {reason}")
        elif kind == "layer_manifest":
            self._land_in_place(msg.layer_manifest)
        elif kind == "handshake":
            self._on_handshake(peer_id, msg.handshake)
        elif kind == "first_token":
            self._on_first_token(msg.first_token)
        elif msg.result.ok:
            self.fail("refused the sender's result: only the receiver reports success")
        else:
            self.fail(f"the sender ended the transfer: {msg.result.error}", notify_peer=False)
            if msg.result.writes_drained:
                self._on_writes_drained(peer_id)

    def abandon(self, peer_id: str, msg: TransferMessage, payload: torch.Tensor) -> None:
        """A layer prepare() accepted will never land: its connection broke mid-way."""
        self._num_landing -= 1
        self._staging.give_back(payload)
        layer_idx = msg.layer_manifest.layer_idx
        self.fail(f"the connection from {peer_id} broke while layer {layer_idx} was landing")

    def _ignored(self, peer_id: str, msg: TransferMessage) -> bool:
        """With a cluster secret: whether `msg` comes from anyone but a sender that proved it
        (its handshake's proof verifies, and later messages come from that same peer). Such
        messages are logged and dropped; they neither feed nor fail the session."""
        if self._auth is None or self.finished:
            return False
        if kind_of(msg) == "handshake" and peer_id != self._peer_id:  # first, or a takeover
            reason = check_handshake(self._auth, self._ticket, msg.handshake)
        elif peer_id != self._peer_id:
            reason = f"a {kind_of(msg)} message from a peer that proved no cluster secret"
        else:
            return False
        if reason is not None:
            logger.warning("receiver %s: ignored a message from %s: %s",
                           self.transfer_id, peer_id, reason)  # fmt: skip
        return reason is not None

    def _from_superseded(self, peer_id: str, msg: TransferMessage) -> bool:
        """A message from a sender a takeover replaced: dropped (logged), harmless."""
        if peer_id not in self._superseded:
            return False
        logger.info("receiver %s: dropped a %s message from %s, which a takeover replaced",
                    self.transfer_id, kind_of(msg), peer_id)  # fmt: skip
        return True

    def _may_take_over(self, peer_id: str, msg: TransferMessage) -> bool:
        """A handshake from another sender while this session still waits: the router's
        retry of a prefill node that died (or hung) after it handshook, with the same ticket
        (and, with a cluster secret, a proof `_ignored` checked). Allowed while no layer of
        the first sender is landing, none was written in place (its writes cannot be fenced)
        and no first token came: the new sender starts the layers over, within the deadline
        the first handshake started."""
        return (
            kind_of(msg) == "handshake"
            and self._peer_id is not None
            and peer_id != self._peer_id
            and not self.finished
            and not self.in_place
            and self._num_landing == 0
            and self.first_token is None
        )

    def _drop_sender(self, peer_id: str) -> None:
        """Forget the sender `peer_id` replaces: its later messages are dropped, the layers
        received so far will be sent again (the blocks are simply overwritten)."""
        logger.warning("receiver %s: %s takes over from %s (a prefill retry); the layers start "
                       "over", self.transfer_id, peer_id, self._peer_id)  # fmt: skip
        assert self._peer_id is not None
        self._superseded.add(self._peer_id)
        self._peer_id = None
        self._layer_token_end = [0] * self.layout.num_layers
        self._send_seq = self._recv_seq = 0

    def _layer_state(self) -> tuple[KVLayout, list[int], int, bool]:
        """What a layer manifest is checked against (manifest_checks)."""
        return self.layout, self._layer_token_end, self.num_tokens, self.first_token is not None

    def _check_sender(self, peer_id: str, msg: TransferMessage) -> str | None:
        """Why this message may not come from `peer_id` now, or None (and count its seq)."""
        kind = kind_of(msg)
        if self.finished:
            return f"the session is already {self.state.name}"
        if self._peer_id is None and kind not in ("handshake", "result"):
            return f"{kind} before the handshake"
        if self._peer_id is not None and peer_id != self._peer_id:
            return f"not from the peer that handshook ({self._peer_id})"
        if kind == "handshake" and self._peer_id is not None:
            return "a second handshake"
        return self._check_envelope(msg)

    def _on_handshake(self, peer_id: str, handshake: transfer_pb2.TransferHandshake) -> None:
        self._peer_id = peer_id
        self._peer_address = handshake.src_address or None
        reason = handshake_refusal(self.layout, self.num_tokens, handshake)
        if reason is not None:
            self.fail(f"refused the handshake from {peer_id}: {reason}", notify_peer=False)
            if self._peer_address is not None:
                ack = transfer_pb2.HandshakeAck(
                    accepted=False, reason=reason, protocol_version=PROTOCOL_VERSION
                )
                self.spawn(self._notify(handshake_ack=ack))
            return
        self.start()
        self._advance(TransferState.WAITING)
        ack = transfer_pb2.HandshakeAck(accepted=True, protocol_version=PROTOCOL_VERSION)
        if self._grants_in_place(handshake):
            self.in_place = True
            self.writes_settled.clear()
            # the sender started before we heard it: its deadline is before this one
            self._quarantine_until_s = self._loop.time() + handshake.timeout_s
            ack.pool.CopyFrom(self._pool_export)
        self.spawn(self._send(handshake_ack=ack))

    def _grants_in_place(self, handshake: transfer_pb2.TransferHandshake) -> bool:
        return (
            handshake.write_in_place
            and self._pool_export is not None
            and bool(self._ticket.kv_device)
            and handshake.kv_device == self._ticket.kv_device
            and 0 < handshake.timeout_s < float("inf")
        )

    def _on_finished(self) -> None:
        """A failed session granted in place: quarantine until the sender drained (or its
        deadline is well past); a successful one has every write behind it."""
        if self.writes_settled.is_set():
            return
        if self.state == TransferState.SUCCESS:
            self.writes_settled.set()
            return
        delay_s = max(0.0, self._quarantine_until_s + QUARANTINE_MARGIN_S - self._loop.time())
        self._quarantine_timer = self._loop.call_later(delay_s, self._on_quarantine_deadline)

    def _on_quarantine_deadline(self) -> None:
        logger.warning(
            "receiver %s: the in-place sender never said it drained; its deadline is past, so "
            "its blocks are reused", self.transfer_id,
        )  # fmt: skip
        self.writes_settled.set()

    def _on_writes_drained(self, peer_id: str) -> None:
        if peer_id != self._peer_id or not self.in_place:
            logger.warning("receiver %s: ignored a drained notice from %s",
                           self.transfer_id, peer_id)  # fmt: skip
            return
        if self._quarantine_timer is not None:
            self._quarantine_timer.cancel()
        self.writes_settled.set()

    def _on_first_token(self, first_token: transfer_pb2.FirstToken) -> None:
        if self.first_token is not None:
            self.fail("refused a second first token")
            return
        missing = [i for i, end in enumerate(self._layer_token_end) if end != self.num_tokens]
        if missing:
            self.fail(f"refused the first token: layers {missing[:8]} are incomplete")
            return
        self.first_token = first_token
        self._maybe_succeed()

    def _land_layer(self, manifest: transfer_pb2.LayerManifest, payload: torch.Tensor) -> None:
        self._num_landing -= 1
        try:
            if not self.finished:  # a failed session never writes, even bytes accepted earlier
                k_cache, v_cache = self._kv_caches[manifest.layer_idx]
                if self._dst_ids is None:
                    self._dst_ids = check_block_ids(
                        self.dst_block_ids, k_cache.shape[0], k_cache.device, unique=True
                    )
                first = manifest.block_offset
                dst_ids = self._dst_ids[first : first + manifest.num_blocks]
                unpack_layer(payload, k_cache, v_cache, dst_ids)
                self._landed(manifest)
        finally:
            self._staging.give_back(payload)

    def _land_in_place(self, manifest: transfer_pb2.LayerManifest) -> None:
        """Layers the sender wrote into our blocks itself (its writes completed before it
        sent the manifest)."""
        layer_ids = [manifest.layer_idx, *manifest.more_layer_ids]
        for layer_idx in layer_ids:
            self._layer_token_end[layer_idx] = manifest.token_end
        self._landed(manifest, layer_ids)

    def _landed(
        self, manifest: transfer_pb2.LayerManifest, layer_ids: list[int] | None = None
    ) -> None:
        """Layers are in our blocks (unpacked here, or written by the sender)."""
        layer_ids = [manifest.layer_idx] if layer_ids is None else layer_ids
        self.num_bytes_received += manifest.num_bytes * len(layer_ids)
        self._advance(TransferState.TRANSFERRING)
        for layer_idx in layer_ids:
            self._notify_layer(layer_idx, manifest.token_end)
        self._maybe_succeed()

    def _notify_layer(self, layer_idx: int, token_end: int) -> None:
        for callback in self._layer_callbacks:
            try:
                callback(layer_idx, token_end)
            except Exception:
                logger.exception("receiver %s: a layer callback failed", self.transfer_id)

    def _maybe_succeed(self) -> None:
        if self.first_token is not None and self._num_landing == 0 and not self.finished:
            self._succeed()
            self.spawn(self._notify(result=transfer_pb2.TransferResult(ok=True)))
