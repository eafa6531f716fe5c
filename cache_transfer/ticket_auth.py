"""Signed tickets and authenticated handshakes (with a cluster secret; pdserve.security).

```
decode node   sign_ticket(auth, ticket, timeout_s)    HMAC over transfer id, dst address, block
                                                      ids, layout hash, token count, expiry
prefill node  check_ticket(auth, ticket) -> why not   before it connects anywhere
              handshake_proof(auth, ticket, src)      sent in TransferHandshake.proof
decode node   check_handshake(auth, ticket, hs)       before any byte of KV is accepted
```

A ticket that does not verify makes the prefill node contact nobody (no failure notice to
its dst_address either), so a forged ticket cannot aim a prefill node at an arbitrary address.
"""

from __future__ import annotations

import hmac
import time

from pdserve.security import ClusterAuth
from pdserve.v1 import node_pb2, transfer_pb2


def _ticket_parts(ticket: node_pb2.TransferTicket) -> tuple:
    return (
        ticket.transfer_id,
        ticket.dst_address,
        ",".join(map(str, ticket.dst_block_ids)),
        ticket.layout_hash,
        ticket.num_tokens,
        repr(ticket.expires_at_unix_s),
        ticket.kv_device,
    )


def sign_ticket(auth: ClusterAuth, ticket: node_pb2.TransferTicket, timeout_s: float) -> None:
    """Set the ticket's expiry (`timeout_s` from now) and signature, in place."""
    ticket.expires_at_unix_s = round(time.time() + timeout_s, 3)
    ticket.signature = auth.sign("kv-ticket", *_ticket_parts(ticket))


def check_ticket(auth: ClusterAuth, ticket: node_pb2.TransferTicket) -> str | None:
    """None when a node holding the secret issued `ticket` and it has not expired."""
    if not ticket.signature:
        return "the ticket is unsigned (this cluster has a secret)"
    if not auth.verify(ticket.signature, "kv-ticket", *_ticket_parts(ticket)):
        return "the ticket's signature does not verify (forged or altered)"
    if time.time() > ticket.expires_at_unix_s + auth.window_s:
        return "the ticket expired"
    return None


def handshake_proof(auth: ClusterAuth, ticket: node_pb2.TransferTicket, src_address: str) -> bytes:
    return auth.sign(
        "kv-handshake", ticket.transfer_id, src_address, ticket.layout_hash, ticket.num_tokens,
        ticket.signature,
    )  # fmt: skip


def check_handshake(
    auth: ClusterAuth, ticket: node_pb2.TransferTicket, handshake: transfer_pb2.TransferHandshake
) -> str | None:
    if not handshake.proof:
        return "the handshake carries no proof of the cluster secret"
    expected = handshake_proof(auth, ticket, handshake.src_address)
    if not hmac.compare_digest(handshake.proof, expected):
        return "the handshake's proof does not verify (a sender without the cluster secret)"
    return None
