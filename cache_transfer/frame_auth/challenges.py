"""The receiver's challenge to each sender: a fresh nonce per connection, accepted once.

```
hello from a connection ──► Challenges.issue(peer_id) -> nonce (at most MAX_OUTSTANDING at once)
                        ──► challenge {nonce, connection: peer_id, proof}   to the hello's src_address
handshake on peer_id    ──► Challenges.take(peer_id) -> its nonce, removed: the proof
                            (tickets.handshake_proof) must cover it, the transfer id and peer_id
```

A captured handshake replayed on another connection finds no nonce of its own connection
that its proof covers; replayed on its own, none at all (taken). A challenge's `proof` (with a
cluster secret) lets the sender act only on challenges and refusals of a secret holder;
`connection` lets it answer only the challenge of its own connection (a hello replayed by
someone else draws a challenge naming their connection, which the honest sender ignores).
"""

from __future__ import annotations

import logging
import secrets
from collections import OrderedDict

from cache_transfer import protocol
from pdserve.security import ClusterAuth
from pdserve.v1 import transfer_pb2

logger = logging.getLogger(__name__)

NONCE_BYTES = 16
MAX_OUTSTANDING = 8  # challenges a receiver keeps unanswered at once (a flood of hellos)


class Challenges:
    def __init__(self, max_outstanding: int = MAX_OUTSTANDING) -> None:
        self._nonces: OrderedDict[str, bytes] = OrderedDict()  # peer_id -> nonce
        self._max = max_outstanding

    def issue(self, peer_id: str) -> bytes | None:
        """A fresh nonce for `peer_id` (replacing one it was given before); None when
        MAX_OUTSTANDING other connections wait with theirs."""
        if peer_id not in self._nonces and len(self._nonces) >= self._max:
            return None
        nonce = self._nonces[peer_id] = secrets.token_bytes(NONCE_BYTES)
        return nonce

    def take(self, peer_id: str) -> bytes | None:
        """`peer_id`'s nonce, which no later handshake may use; None if it has none."""
        return self._nonces.pop(peer_id, None)

    def outstanding(self) -> dict[str, bytes]:
        return dict(self._nonces)

    def answer(
        self,
        peer_id: str,
        hello: transfer_pb2.TransferHello,
        auth: ClusterAuth | None,
        transfer_id: str,
    ) -> bytes | None:
        """The challenge header for a hello on `peer_id` (a fresh nonce, proved with the
        secret), to send to its src_address; None (logged) when there is none to give."""
        nonce = self.issue(peer_id)
        if nonce is None or not hello.src_address:
            why = "no src_address" if nonce else f"{self._max} challenges wait already"
            logger.warning("transfer %s: no challenge for %s (%s)", transfer_id, peer_id, why)
            return None
        challenge = make_challenge(auth, transfer_id, peer_id, nonce)
        return protocol.encode(transfer_id, 0, challenge=challenge)


def _proof(
    auth: ClusterAuth, transfer_id: str, challenge: transfer_pb2.HandshakeChallenge
) -> bytes:
    return auth.sign(
        "kv-challenge", transfer_id, challenge.connection, challenge.nonce, challenge.refused
    )


def make_challenge(
    auth: ClusterAuth | None,
    transfer_id: str,
    connection: str,
    nonce: bytes = b"",
    refused: str = "",
) -> transfer_pb2.HandshakeChallenge:
    """A challenge (a nonce) or a refusal (why the receiver cannot take a handshake) for the
    sender on `connection`; proved with the secret, if any."""
    challenge = transfer_pb2.HandshakeChallenge(nonce=nonce, connection=connection, refused=refused)
    if auth is not None:
        challenge.proof = _proof(auth, transfer_id, challenge)
    return challenge


def challenge_misfit(
    auth: ClusterAuth | None,
    transfer_id: str,
    challenge: transfer_pb2.HandshakeChallenge,
    connection: str,
) -> str | None:
    """Why a sender on `connection` must ignore `challenge`, or None."""
    if challenge.connection != connection:
        return f"it names the connection {challenge.connection!r}, not ours ({connection!r})"
    if auth is not None and not auth.verify(challenge.proof, "kv-challenge", transfer_id,
                                            challenge.connection, challenge.nonce,
                                            challenge.refused):  # fmt: skip
        return "its proof does not verify (not from a holder of the cluster secret)"
    if not challenge.refused and len(challenge.nonce) != NONCE_BYTES:
        return f"a {len(challenge.nonce)}-byte nonce"
    return None
