"""`KVTransferManager`: one per node; one transport, every live KV hand-off keyed by transfer_id.

    decode node:  receiver = manager.create_receiver(dst_block_ids, num_tokens, timeout_s, ...)
                  send receiver.ticket() to the router; await receiver.wait(); free on FAILED
    prefill node: sender = manager.create_sender(ticket, timeout_s, ceiling_s=...)
                  sender.beat(n) as the engine progresses; await sender.send_layer(...) per
                  layer, send_first_token(...), wait(); release the blocks either way

Incoming messages are decoded once and routed to their session by transfer id and kind
(with their bytes: a MAC covers them). Headers that do not decode, or name no live session,
are refused and logged (at DEBUG when they are late for a session that ended here: a race, not
an attack); no session is touched. A session leaves the manager the moment it finishes. A
hello or handshake for a receiver that finished already (e.g. it was cancelled) is answered
with a refusal, so its sender fails at once instead of at its deadline (`FinishedReceivers`,
which the manager owns). The live sessions, and how their ends are counted: `LiveSessions`,
which the manager owns too.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable, Sequence

import torch

from cache_transfer import protocol
from cache_transfer.finished_receivers import FinishedReceivers
from cache_transfer.in_place.pool_sharing import PoolSharing
from cache_transfer.layout import KVCaches, KVLayout, kv_device_id
from cache_transfer.live_sessions import LiveSessions
from cache_transfer.packing.packed_layer import check_kv_cache
from cache_transfer.packing.staging_pool import StagingPool
from cache_transfer.receiver import KVReceiver
from cache_transfer.route_slice import ROUTE_SEPARATOR, RouteSlice
from cache_transfer.sender import KVSender
from cache_transfer.session import NOTIFY_TIMEOUT_S
from cache_transfer.transports.base import KVTransport
from cache_transfer.transports.coalescing import CoalescingTransport
from pdserve.security import ClusterAuth
from pdserve.v1 import node_pb2, transfer_pb2

logger = logging.getLogger(__name__)

MAX_HEADER_BYTES = 1 << 20  # a control message (headers are a few hundred bytes)

# Makes the receiver of an unknown route's first message (from peer_id), or None (refused).
RouteAcceptor = Callable[[str, protocol.TransferMessage], KVReceiver | None]


class KVTransferManager:
    def __init__(
        self,
        transport: KVTransport,
        layout: KVLayout,
        kv_caches: KVCaches | None = None,
        max_idle_staging_bytes: int = 512 << 20,
        auth: ClusterAuth | None = None,
        sharing: PoolSharing | None = None,
        kv_device: torch.device | None = None,
        kv_device_name: str | None = None,
        encrypt: bool = False,
    ) -> None:
        """Start receiving on `transport` (call inside the running event loop). `kv_caches`
        (per layer `(k_cache, v_cache)`) is where received KV lands; a node that only sends
        may omit it. Staging buffers are pooled across transfers, up to
        `max_idle_staging_bytes` kept idle. With `auth` (the cluster secret), tickets are
        signed and verified and handshakes prove the secret (cache_transfer.tickets).
        With `sharing`, writes in place: receivers grant them to a sender on this GPU, senders
        whose cache is on `kv_device` (named `kv_device_name`, default kv_device_id) ask to
        write into a receiver there. `encrypt` (needs `auth`; host payloads): senders encrypt
        their payloads and first token, receivers take encrypted transfers only."""
        if encrypt and auth is None:
            raise ValueError("encrypted KV frames (--kv-encrypt) need a cluster secret")
        if kv_caches is not None:
            _check_caches(layout, kv_caches)
        self.layout, self.auth, self.encrypt = layout, auth, encrypt
        # sends to one peer begun in the same loop turn (a batch's transfers) go as one message
        self._transport = CoalescingTransport(transport)
        self.transport_caveat = transport.caveat  # for the node's start-up warning
        self._kv_caches = kv_caches
        self._staging = StagingPool(max_idle_staging_bytes)
        self._sharing = sharing
        self._kv_device = kv_device
        self._kv_device_name = kv_device_name  # None: the receivers' caches' (kv_device_id)
        self._sender_kv_device = kv_device_name or (
            kv_device_id(kv_device) if kv_device is not None else ""
        )
        self._pool_export = _export(sharing, kv_caches)
        self._finished = FinishedReceivers(self._transport, auth)  # late handshakes refused
        self._sessions = LiveSessions(self._finished)  # the live ones, their ends counted
        self._quarantined = self._sessions.quarantined  # (routed a sender's drained notice)
        self._acceptors: dict[str, RouteAcceptor] = {}  # TP hand-offs' routes, by transfer id
        transport.limit_inbound(self.max_frame_bytes)
        transport.start(self)

    @property
    def address(self) -> str:
        """This node's KV transport address (what tickets carry)."""
        return self._transport.address

    @property
    def max_frame_bytes(self) -> int:
        """The largest frame a peer may send this node: one layer of the whole pool (no
        ticket reserves more), or headers only for a node that receives no KV."""
        if self._kv_caches is None:
            return MAX_HEADER_BYTES
        return max(self.layout.layer_bytes(self._kv_caches[0][0].shape[0]), MAX_HEADER_BYTES)

    @property
    def num_pending(self) -> int:
        """Transfers in flight: sending, or awaiting KV."""
        return len(self._sessions)

    @property
    def num_succeeded(self) -> int:
        return self._sessions.num_succeeded

    @property
    def num_failed(self) -> int:
        return self._sessions.num_failed

    @property
    def num_in_place(self) -> int:
        """Of num_succeeded: written in place."""
        return self._sessions.num_in_place

    @property
    def num_bytes_moved(self) -> int:
        """KV bytes the successful hand-offs moved (sent here, or received)."""
        return self._sessions.num_bytes_moved

    @property
    def num_bytes_skipped(self) -> int:
        """KV bytes the successful hand-offs did not move: the decode node held them."""
        return self._sessions.num_bytes_skipped

    def create_receiver(
        self,
        dst_block_ids: Sequence[int],
        num_tokens: int,
        timeout_s: float,
        transfer_id: str | None = None,
        max_ceiling_s: float | None = None,
        log_id: str = "",
        num_cached_blocks: int = 0,
        route: RouteSlice | None = None,
    ) -> KVReceiver:
        """A session receiving `num_tokens` tokens of KV (after the prompt's `num_cached_blocks`
        held here: `KVSuffix`) into blocks reserved for it: it fails after `timeout_s` without
        progress, or at the sender's ceiling (at most `max_ceiling_s`, default `timeout_s`);
        `log_id`: its log lines'; `route`: a TP hand-off's (tp/fan_in.py), a head slice."""
        if self._kv_caches is None:
            raise ValueError("this manager has no kv_caches to receive into; pass them at init")
        transfer_id = transfer_id or uuid.uuid4().hex
        self._sessions.check_new(transfer_id)
        layout = route.layout if route else self.layout
        kv_caches = route.kv_caches if route else self._kv_caches
        receiver = KVReceiver(
            self._transport, self._staging, layout, kv_caches, transfer_id, dst_block_ids,
            num_tokens, timeout_s, auth=self.auth, max_ceiling_s=max_ceiling_s,
            pool_export=None if route else self._pool_export, kv_device=self._kv_device_name,
            require_encryption=self.encrypt, log_id=log_id, num_cached_blocks=num_cached_blocks,
            route=route.receiver if route else None,
        )  # fmt: skip
        return self._sessions.add_receiver(receiver)

    def create_sender(
        self,
        ticket: node_pb2.TransferTicket,
        timeout_s: float,
        ceiling_s: float | None = None,
        log_id: str = "",
        route: RouteSlice | None = None,
    ) -> KVSender:
        """A session sending to the receiver that issued `ticket` (FAILED at once, and the
        receiver told, when the ticket does not match this node's layout); it handshakes at
        once, fails after `timeout_s` without progress or at `ceiling_s` (default
        `timeout_s`) from now. `route`: a TP hand-off's (tp/fan_out.py), never in place."""
        self._sessions.check_new(ticket.transfer_id)
        sender = KVSender(
            self._transport, self._staging, route.layout if route else self.layout, ticket,
            timeout_s, auth=self.auth, ceiling_s=ceiling_s,
            sharing=None if route else self._sharing, kv_device=self._sender_kv_device,
            device=self._kv_device, encrypt=self.encrypt, log_id=log_id, route=route,
        )  # fmt: skip
        return self._sessions.add_sender(sender)

    def accept_routes(self, transfer_id: str, acceptor: RouteAcceptor | None) -> None:
        """`acceptor` may make the receiver of a TP hand-off's unknown route `<transfer_id>:...`
        on its first message (cache_transfer/tp/); None: no more."""
        self._acceptors.pop(transfer_id, None)
        if acceptor is not None:
            self._acceptors[transfer_id] = acceptor

    def retire(self, receiver: KVReceiver, reason: str) -> None:
        """End a receiver no sender used (the hand-off went another way): not counted, not told."""
        self._sessions.retire(receiver, reason)

    def get(self, transfer_id: str) -> KVReceiver | KVSender | None:
        return self._sessions.get(transfer_id)

    def abort(self, transfer_id: str, reason: str) -> bool:
        """Fail a live transfer and tell its peer; False when none has that id."""
        session = self.get(transfer_id)
        if session is not None:
            session.abort(reason)
        return session is not None

    def cancel(self, transfer_id: str, reason: str) -> bool:
        """`abort`, for a transfer nobody needs any more (logged at DEBUG)."""
        session = self.get(transfer_id)
        if session is not None:
            session.cancel(reason)
        return session is not None

    def prepare(self, peer_id: str, header: bytes, payload_bytes: int) -> torch.Tensor | None:
        """TransportHandler: where a payload may land (only a receiver's accepted layer)."""
        routed = self._route(peer_id, header)
        if routed is None:
            return None
        session, msg = routed
        if isinstance(session, KVReceiver):
            return session.prepare(peer_id, msg, payload_bytes)
        session.fail(f"refused a {payload_bytes}-byte payload from {peer_id}: senders take none")
        return None

    def complete(self, peer_id: str, header: bytes, payload: torch.Tensor | None) -> None:
        """TransportHandler: a whole message for a session."""
        routed = self._route(peer_id, header)
        if routed is not None:
            session, msg = routed
            session.complete(peer_id, msg, payload, header)
        elif payload is not None:  # its receiver finished while the payload was landing
            self._staging.give_back(payload)

    def abandon(self, peer_id: str, header: bytes, payload: torch.Tensor) -> None:
        """TransportHandler: a payload prepare() accepted will never land (the connection
        broke): its receiver fails."""
        routed = self._route(peer_id, header)
        if routed is not None and isinstance(routed[0], KVReceiver):
            routed[0].abandon(peer_id, routed[1], payload)
        else:  # its receiver finished while the payload was landing
            self._staging.give_back(payload)

    async def close(self) -> None:
        """Fail every live transfer (peers are told, within NOTIFY_TIMEOUT_S), then close the
        transport."""
        sessions = self._sessions.all()
        for session in sessions:
            session.abort("the transfer manager is closing")
        await asyncio.gather(*(session.settle(NOTIFY_TIMEOUT_S) for session in sessions))
        await self._transport.close()

    def _route(
        self, peer_id: str, header: bytes
    ) -> tuple[KVReceiver | KVSender, protocol.TransferMessage] | None:
        try:
            msg = protocol.decode(header)
        except protocol.ProtocolError as e:
            logger.warning("refused a message from %s: %s", peer_id, e)
            return None
        kind = protocol.kind_of(msg)
        session: KVReceiver | KVSender | None = None
        if kind in protocol.TO_RECEIVER_KINDS:
            session = self._sessions.receivers.get(msg.transfer_id)
        if session is None and kind in protocol.TO_SENDER_KINDS:
            session = self._sessions.senders.get(msg.transfer_id)
        if session is None and kind == "result" and msg.result.writes_drained:
            session = self._quarantined.get(msg.transfer_id)
        if session is None and kind in protocol.TO_RECEIVER_KINDS and self._acceptors:
            session = self._accept_route(peer_id, msg)
        if session is None:
            self._refuse_stray(peer_id, msg)
            return None
        return session, msg

    def _accept_route(self, peer_id: str, msg: protocol.TransferMessage) -> KVReceiver | None:
        """The receiver a TP hand-off's acceptor makes for a route's first message, or None."""
        acceptor = self._acceptors.get(msg.transfer_id.split(ROUTE_SEPARATOR, 1)[0])
        return acceptor(peer_id, msg) if acceptor is not None else None

    def _refuse_stray(self, peer_id: str, msg: protocol.TransferMessage) -> None:
        """A message for no live session of its kind: the session it names fails (it came to
        the wrong side), a late handshake is answered, the rest is dropped (logged)."""
        kind = protocol.kind_of(msg)
        stray = self.get(msg.transfer_id)
        if stray is not None and self.auth is not None:  # nobody's we could tell: dropped
            logger.warning("dropped a %s message from %s for %s %s", kind, peer_id,
                           stray.role, msg.transfer_id)  # fmt: skip
        elif stray is not None:
            stray.fail(f"refused a {kind} message from {peer_id}: not for a {stray.role}")
        elif kind in ("hello", "handshake") and msg.transfer_id in self._finished:
            self._finished.refuse(peer_id, msg)
        else:
            # late for a session that ended here (a race: e.g. the request finished while a
            # result, an ack or a layer was on its way), or for none at all
            late = kind in protocol.TO_SENDER_KINDS or msg.transfer_id in self._finished
            level = logging.DEBUG if late else logging.WARNING
            logger.log(level, "refused a %s message from %s: no live transfer %r", kind,
                       peer_id, msg.transfer_id)  # fmt: skip


def _check_caches(layout: KVLayout, kv_caches: KVCaches) -> None:
    if len(kv_caches) != layout.num_layers:
        raise ValueError(f"kv_caches has {len(kv_caches)} layers, the layout {layout.num_layers}")
    for k_cache, v_cache in kv_caches:
        check_kv_cache(layout, k_cache, v_cache)


def _export(
    sharing: PoolSharing | None, kv_caches: KVCaches | None
) -> transfer_pb2.KVPoolExport | None:
    """The caches' export for writes in place (None: off)."""
    if sharing is None or kv_caches is None:
        return None
    try:
        return sharing.export(kv_caches)
    except Exception as error:  # noqa: BLE001 - e.g. an allocator that cannot share
        logger.warning("KV writes in place are off: the KV cache cannot be shared (%r)", error)
        return None
