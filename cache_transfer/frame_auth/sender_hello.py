"""`SenderHello`: the part of a `KVSender` before its handshake.

```
created (ticket verified) ──► hello {src_address} to the ticket's dst_address, at once: the
    receiver is reached (or found unreachable: the transfer fails) while the prefill queues
challenge for our connection ──► nonce (with a secret: its proof verified; the transfer's
    FrameKey bound to the session's FrameSealer from here on, and with `encrypt` its
    FrameCipher) ──► `answered`: the handshake may go, proving the nonce
refusal for our connection ──► the transfer fails at once (the receiver ended)
a challenge for another connection, a second one, or one without a valid proof ──► ignored
```
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from cache_transfer import protocol
from cache_transfer.frame_auth.challenges import challenge_misfit
from cache_transfer.frame_auth.frame_key import FrameKey
from cache_transfer.frame_auth.frame_sealer import FrameSealer
from cache_transfer.transports.base import KVTransport, TransportError
from pdserve.security import ClusterAuth
from pdserve.v1 import transfer_pb2

logger = logging.getLogger(__name__)


class SenderHello:
    def __init__(
        self,
        transport: KVTransport,
        auth: ClusterAuth | None,
        transfer_id: str,
        frames: FrameSealer,
        encrypt: bool = False,
    ) -> None:
        """`frames`: the session's, bound once challenged; `encrypt`: its payloads and first
        token encrypted (needs `auth`)."""
        if encrypt and auth is None:
            raise ValueError("encrypted KV frames need a cluster secret (the key comes from it)")
        self._transport = transport
        self._auth = auth
        self._transfer_id = transfer_id
        self._frames = frames
        self.encrypt = encrypt
        self.connection = ""  # our transport's peer id at the receiver (what proofs cover)
        self.nonce: bytes | None = None
        self.answered = asyncio.Event()  # challenged (or the session ended)

    async def say(
        self, peer_address: str, timeout_s: float, on_error: Callable[[str], None]
    ) -> None:
        """Send the hello to `peer_address` (within `timeout_s`, and the transport's connect
        timeout); `on_error(why)` when it cannot be sent."""
        self.connection = self._transport.connection_id(peer_address)
        hello = transfer_pb2.TransferHello(src_address=self._transport.address)
        header = protocol.encode(self._transfer_id, 0, hello=hello)
        try:
            async with asyncio.timeout(timeout_s):
                await self._transport.send(peer_address, header)
        except (TimeoutError, TransportError) as error:
            on_error(f"could not reach the receiver at {peer_address}: {error or 'timed out'}")

    async def wait_answered(self, timeout_s: float) -> bool:
        """Until challenged (or the session ended); False after `timeout_s`."""
        try:
            async with asyncio.timeout(timeout_s):
                await self.answered.wait()
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
