"""`SenderHello`: the part of a `KVSender` before its handshake.

```
created (ticket verified) ──► hello {src_address} to the ticket's dst_address, at once: the
    receiver is reached (or found unreachable: the transfer fails) while the prefill queues
challenge for our connection ──► nonce (with a secret: its proof verified; the transfer's
    FrameKey bound to the session's FrameSealer from here on, and with `encrypt` its
    FrameCipher) ──► `answered`: the handshake (`handshake()`) may go, proving the nonce
refusal for our connection ──► the transfer fails at once (the receiver ended)
a challenge for another connection, a second one, or one without a valid proof ──► ignored
```
"""

from __future__ import annotations

import asyncio
import logging

from cache_transfer import protocol
from cache_transfer.frame_auth.challenges import challenge_misfit
from cache_transfer.frame_auth.frame_key import FrameKey
from cache_transfer.frame_auth.frame_sealer import FrameSealer
from cache_transfer.layout import HeadSlice, KVLayout
from cache_transfer.tickets import handshake_for
from cache_transfer.transports.base import KVTransport, TransportError
from pdserve.security import ClusterAuth
from pdserve.v1 import node_pb2, transfer_pb2

logger = logging.getLogger(__name__)


class SenderHello:
    def __init__(
        self,
        transport: KVTransport,
        auth: ClusterAuth | None,
        ticket: node_pb2.TransferTicket,
        frames: FrameSealer,
        encrypt: bool = False,
    ) -> None:
        """`frames`: the session's, bound once challenged; `encrypt`: its payloads and first
        token encrypted (needs `auth`)."""
        if encrypt and auth is None:
            raise ValueError("encrypted KV frames need a cluster secret (the key comes from it)")
        self._transport = transport
        self._auth = auth
        self._ticket = ticket
        self._transfer_id = ticket.transfer_id
        self._frames = frames
        self.encrypt = encrypt
        self.connection = ""  # our transport's peer id at the receiver (what proofs cover)
        self.nonce: bytes | None = None
        self.answered = asyncio.Event()  # challenged (or the session ended)
        self.acked = asyncio.Event()  # the handshake accepted (or the session ended)

    async def say(self, peer_address: str, timeout_s: float) -> str | None:
        """Send the hello to `peer_address` (within `timeout_s`, and the transport's connect
        timeout); why it could not be sent, or None."""
        self.connection = self._transport.connection_id(peer_address)
        hello = transfer_pb2.TransferHello(src_address=self._transport.address)
        header = protocol.encode(self._transfer_id, 0, hello=hello)
        try:
            async with asyncio.timeout(timeout_s):
                await self._transport.send(peer_address, header)
        except (TimeoutError, TransportError) as error:
            return f"could not reach the receiver at {peer_address}: {error or 'timed out'}"
        return None

    def session_ended(self) -> None:
        """Nothing more is waited for."""
        self.answered.set()
        self.acked.set()

    @staticmethod
    async def wait(event: asyncio.Event, timeout_s: float) -> bool:
        """Until `event` (`answered`, `acked`) is set; False after `timeout_s`."""
        try:
            async with asyncio.timeout(timeout_s):
                await event.wait()
        except TimeoutError:
            return False
        return True

    def take(self, peer_id: str, challenge: transfer_pb2.HandshakeChallenge) -> str | None:
        """Why the receiver refused us (a refusal for our connection, at any time), or None:
        our challenge (`nonce` set, `answered`), or one to ignore (logged)."""
        ignored = challenge_misfit(self._auth, self._transfer_id, challenge, self.connection)
        if ignored is None and self.nonce is not None and not challenge.refused:
            ignored = "a second challenge"
        if ignored is not None:
            logger.warning("sender %s: ignored a challenge from %s: %s",
                           self._transfer_id, peer_id, ignored)  # fmt: skip
            return None
        if challenge.refused:
            return challenge.refused
        self.nonce = challenge.nonce
        if self._auth is not None:
            key = FrameKey(self._auth, self._transfer_id, self.nonce, self.connection)
            self._frames.bind(key, self.encrypt)
        self.answered.set()
        return None

    def handshake(
        self,
        layout: KVLayout,
        kv_device: str,
        write_in_place: bool,
        ceiling_s: float,
        heads: HeadSlice | None = None,
    ) -> transfer_pb2.TransferHandshake:
        """Once answered: the handshake (tickets.handshake_for), proving our nonce on our
        connection with a secret; `ceiling_s`: the sender's, which the receiver adopts."""
        return handshake_for(
            self._ticket, layout, self._transport.address, self._auth, kv_device,
            write_in_place, ceiling_s, self.nonce or b"", self.connection, self.encrypt, heads,
        )  # fmt: skip
