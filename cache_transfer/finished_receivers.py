"""`FinishedReceivers`: the receivers a node issued that ended already, and why (the last
`MAX_FINISHED_REMEMBERED`). A `KVTransferManager` owns one: a hello or handshake for one of
them (its receiver was not started in time, or cancelled) is answered with a refusal, best
effort, so its sender fails at once instead of at its deadline. A forged id (never issued
here) gets no answer. With a cluster secret the refusal is a challenge carrying `refused`,
proved with the secret, for the connection that asked; a handshake is answered only if it
proves the challenge that receiver had given its connection.

    remember(receiver, why)               a receiver ended
    transfer_id in finished               one of those
    refuse(peer_id, msg)                  answer a late hello or handshake for it
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from dataclasses import dataclass

from cache_transfer import protocol
from cache_transfer.frame_auth.challenges import make_challenge
from cache_transfer.receiver import KVReceiver
from cache_transfer.session import NOTIFY_TIMEOUT_S
from cache_transfer.tickets import check_handshake
from cache_transfer.transports.base import KVTransport, TransportError
from pdserve.security import ClusterAuth
from pdserve.v1 import node_pb2, transfer_pb2

logger = logging.getLogger(__name__)

MAX_FINISHED_REMEMBERED = 4096  # finished receivers whose late hellos and handshakes are refused
ALREADY_ENDED = "the receiver already ended: "  # how a refusal to a late hello/handshake begins


@dataclass
class _Finished:
    why: str
    ticket: node_pb2.TransferTicket
    nonces: dict[str, bytes]  # the challenges it had given, unanswered (peer_id -> nonce)
    log_id: str  # its request's id


class FinishedReceivers:
    def __init__(self, transport: KVTransport, auth: ClusterAuth | None) -> None:
        """`transport` carries the refusals; `auth`: the cluster secret, if any."""
        self._transport = transport
        self._auth = auth
        self._finished: OrderedDict[str, _Finished] = OrderedDict()
        self._refusals: set[asyncio.Task[None]] = set()

    def __contains__(self, transfer_id: str) -> bool:
        return transfer_id in self._finished

    def remember(self, receiver: KVReceiver, why: str) -> None:
        nonces = receiver.challenges.outstanding()
        finished = _Finished(why, receiver.ticket(), nonces, receiver.log_id)
        self._finished[receiver.transfer_id] = finished
        while len(self._finished) > MAX_FINISHED_REMEMBERED:
            self._finished.popitem(last=False)

    def refuse(self, peer_id: str, msg: protocol.TransferMessage) -> None:
        """Tell a sender whose receiver finished before its hello or handshake (best effort)."""
        finished = self._finished[msg.transfer_id]
        tag = {"request_id": finished.log_id} if finished.log_id else None
        kind = protocol.kind_of(msg)
        if kind != "hello" and self._auth is not None:
            nonce = finished.nonces.pop(peer_id, None)
            forged = check_handshake(self._auth, finished.ticket, msg.handshake, nonce, peer_id)
            if forged is not None:  # with a secret, only a sender that proves it is answered
                logger.warning("ignored a late handshake from %s for transfer %s: %s",
                               peer_id, msg.transfer_id, forged, extra=tag)  # fmt: skip
                return
        reason = ALREADY_ENDED + finished.why
        # (the receiver logged why it ended; a cancelled one was nobody's failure)
        level = logging.DEBUG if finished.why.startswith("cancelled") else logging.INFO
        logger.log(level, "refused a %s from %s for transfer %s: %s",
                   kind, peer_id, msg.transfer_id, reason, extra=tag)  # fmt: skip
        address = msg.hello.src_address if kind == "hello" else msg.handshake.src_address
        if address:
            self._send(address, self._refusal(peer_id, msg, reason, kind == "hello"))

    def _refusal(
        self, peer_id: str, msg: protocol.TransferMessage, reason: str, is_hello: bool
    ) -> bytes:
        """A refused ack (an open cluster's late handshake, as before hellos), else a refusal
        challenge (proved with the secret, if any)."""
        if is_hello or self._auth is not None:
            refusal = make_challenge(self._auth, msg.transfer_id, peer_id, refused=reason)
            return protocol.encode(msg.transfer_id, 0, challenge=refusal)
        ack = transfer_pb2.HandshakeAck(
            accepted=False, reason=reason, protocol_version=protocol.PROTOCOL_VERSION
        )
        return protocol.encode(msg.transfer_id, 0, handshake_ack=ack)

    def _send(self, address: str, header: bytes) -> None:
        async def send() -> None:
            try:
                await asyncio.wait_for(self._transport.send(address, header), NOTIFY_TIMEOUT_S)
            except (TimeoutError, TransportError) as error:
                logger.info("could not send a refusal to %s: %s", address, error)

        task = asyncio.get_running_loop().create_task(send())
        self._refusals.add(task)
        task.add_done_callback(self._refusals.discard)
