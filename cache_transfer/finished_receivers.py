"""`FinishedReceivers`: the receivers a node issued that ended already, and why (the last
`MAX_FINISHED_REMEMBERED`). A `KVTransferManager` owns one: a handshake for one of them (its
receiver was not started in time, or cancelled) is answered with a refused ack, best effort,
so its sender fails at once instead of at its deadline. A forged id (never issued here) gets
no answer; with a cluster secret, neither does a handshake that does not prove it.

    remember(transfer_id, why, ticket)     a receiver ended
    transfer_id in finished                one of those
    refuse_handshake(peer_id, msg)         answer a late handshake for it
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict

from cache_transfer import protocol
from cache_transfer.session import NOTIFY_TIMEOUT_S
from cache_transfer.tickets import check_handshake
from cache_transfer.transports.base import KVTransport, TransportError
from pdserve.security import ClusterAuth
from pdserve.v1 import node_pb2, transfer_pb2

logger = logging.getLogger(__name__)

MAX_FINISHED_REMEMBERED = 4096  # finished receivers whose late handshakes are refused
ALREADY_ENDED = "the receiver already ended: "  # how a refused ack to a late handshake begins


class FinishedReceivers:
    def __init__(self, transport: KVTransport, auth: ClusterAuth | None) -> None:
        """`transport` carries the refusals; `auth`: the cluster secret, if any."""
        self._transport = transport
        self._auth = auth
        # receiver transfer id -> (why it ended, its ticket, its request's id)
        self._finished: OrderedDict[str, tuple[str, node_pb2.TransferTicket, str]] = OrderedDict()
        self._refusals: set[asyncio.Task[None]] = set()

    def __contains__(self, transfer_id: str) -> bool:
        return transfer_id in self._finished

    def remember(
        self, transfer_id: str, why: str, ticket: node_pb2.TransferTicket, log_id: str = ""
    ) -> None:
        self._finished[transfer_id] = (why, ticket, log_id)
        while len(self._finished) > MAX_FINISHED_REMEMBERED:
            self._finished.popitem(last=False)

    def refuse_handshake(self, peer_id: str, msg: protocol.TransferMessage) -> None:
        """Tell a sender whose receiver finished before its handshake (best effort)."""
        why, ticket, log_id = self._finished[msg.transfer_id]
        tag = {"request_id": log_id} if log_id else None
        forged = check_handshake(self._auth, ticket, msg.handshake) if self._auth else None
        if forged is not None:  # with a secret, only a sender that proves it is answered
            logger.warning("ignored a late handshake from %s for transfer %s: %s",
                           peer_id, msg.transfer_id, forged, extra=tag)  # fmt: skip
            return
        reason = ALREADY_ENDED + why
        # (the receiver logged why it ended; a cancelled one was nobody's failure)
        level = logging.DEBUG if why.startswith("cancelled") else logging.INFO
        logger.log(level, "refused a handshake from %s for transfer %s: %s",
                   peer_id, msg.transfer_id, reason, extra=tag)  # fmt: skip
        address = msg.handshake.src_address
        if not address:
            return
        ack = transfer_pb2.HandshakeAck(
            accepted=False, reason=reason, protocol_version=protocol.PROTOCOL_VERSION
        )
        header = protocol.encode(msg.transfer_id, 0, handshake_ack=ack)

        async def send() -> None:
            try:
                await asyncio.wait_for(self._transport.send(address, header), NOTIFY_TIMEOUT_S)
            except (TimeoutError, TransportError) as error:
                logger.info("could not refuse transfer %s: %s", msg.transfer_id, error)

        task = asyncio.get_running_loop().create_task(send())
        self._refusals.add(task)
        task.add_done_callback(self._refusals.discard)
