"""`InPlaceGrant`: the writes-in-place part of one `KVReceiver`, which owns one.

grant(handshake, ack)    a sender on this very GPU asked: the ack carries the pool's export
on_finished(state)       a failed session granted in place: quarantine its blocks until ...
on_drained(peer, sender) ... the sender says every write it launched is done, or
(the quarantine timer)   its own deadline (handshake.timeout_s) is past by
                         QUARANTINE_MARGIN_S
writes_settled           set once no write of the sender can land any more: the node
                         reuses the blocks only then
"""

from __future__ import annotations

import asyncio
import logging

from cache_transfer.state import TransferState
from pdserve.v1 import transfer_pb2

logger = logging.getLogger(__name__)

# After a failed transfer written in place: how long past the sender's own deadline its last
# launched write may still land (the deadline stops new writes; one kernel takes microseconds).
QUARANTINE_MARGIN_S = 2.0


class InPlaceGrant:
    def __init__(
        self,
        transfer_id: str,
        pool_export: transfer_pb2.KVPoolExport | None,
        kv_device: str,
        log_id: str = "",
    ) -> None:
        """`pool_export`: this node's caches, exported (None: never grant); `kv_device`: their
        GPU, as the ticket names it; `log_id`: the request id log lines carry."""
        self._transfer_id = transfer_id
        self._tag = {"request_id": log_id} if log_id else None
        self._pool_export = pool_export
        self._kv_device = kv_device
        self._loop = asyncio.get_running_loop()
        self.granted = False  # the sender was granted writes in place
        self.writes_settled = asyncio.Event()  # no write of the sender can land any more
        self.writes_settled.set()  # (until a grant)
        self._quarantine_until_s = 0.0
        self._quarantine_timer: asyncio.TimerHandle | None = None

    def grant(
        self, handshake: transfer_pb2.TransferHandshake, ack: transfer_pb2.HandshakeAck
    ) -> None:
        """Grant writes in place in `ack` if the (accepted) handshake asks for it from this
        GPU, within a deadline of its own."""
        if not (
            handshake.write_in_place
            and self._pool_export is not None
            and bool(self._kv_device)
            and handshake.kv_device == self._kv_device
            and 0 < handshake.timeout_s < float("inf")
        ):
            return
        self.granted = True
        self.writes_settled.clear()
        # the sender started before we heard it: its deadline is before this one
        self._quarantine_until_s = self._loop.time() + handshake.timeout_s
        ack.pool.CopyFrom(self._pool_export)

    def on_finished(self, state: TransferState) -> None:
        """A failed session granted in place: quarantine until the sender drained (or its
        deadline is well past); a successful one has every write behind it."""
        if self.writes_settled.is_set():
            return
        if state == TransferState.SUCCESS:
            self.writes_settled.set()
            return
        delay_s = max(0.0, self._quarantine_until_s + QUARANTINE_MARGIN_S - self._loop.time())
        self._quarantine_timer = self._loop.call_later(delay_s, self._on_quarantine_deadline)

    def on_drained(self, peer_id: str, sender_id: str | None) -> None:
        """`peer_id` says every write it launched is done (heard only from the granted sender,
        `sender_id`)."""
        if peer_id != sender_id or not self.granted:
            logger.warning("receiver %s: ignored a drained notice from %s",
                           self._transfer_id, peer_id, extra=self._tag)  # fmt: skip
            return
        if self._quarantine_timer is not None:
            self._quarantine_timer.cancel()
        self.writes_settled.set()

    def _on_quarantine_deadline(self) -> None:
        logger.warning(
            "receiver %s: the in-place sender never said it drained; its deadline is past, so "
            "its blocks are reused", self._transfer_id, extra=self._tag,
        )  # fmt: skip
        self.writes_settled.set()
