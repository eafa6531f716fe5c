"""A transfer's ticket: issued by the receiver, checked by the sender, proved in the handshake.

```
decode node   issue_ticket(...)                       a receiver's ticket (signed with a secret)
prefill node  ticket_misfit(layout, ticket) -> why    the ticket does not fit this node's KV
with a cluster secret (pdserve.security):
decode node   sign_ticket(auth, ticket, timeout_s)    HMAC over transfer id, dst address, block
                                                      ids, layout hash, token count, expiry,
                                                      kv device, cached blocks, a TP node's
                                                      ranks (addresses, kv heads)
prefill node  check_ticket(auth, ticket) -> why not   before it connects anywhere
              handshake_for(ticket, ...)              the handshake, with its proof:
              handshake_proof(auth, ticket, src,      TransferHandshake.proof: bound to the
                              nonce, connection)      challenge's nonce and the connection
decode node   check_handshake(auth, ticket, hs,       before any byte of KV is accepted (the
                              nonce, connection)      nonce it issued to that connection, once)
```

A ticket that does not verify makes the prefill node contact nobody (no failure notice to
its dst_address either), so a forged ticket cannot aim a prefill node at an arbitrary address.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Sequence

from cache_transfer.layout import HeadSlice, KVLayout, dtype_mismatch
from cache_transfer.protocol import PROTOCOL_VERSION
from cache_transfer.suffix import KVSuffix
from pdserve.security import ClusterAuth
from pdserve.v1 import node_pb2, transfer_pb2


def _ticket_parts(ticket: node_pb2.TransferTicket) -> tuple[str | int, ...]:
    return (
        ticket.transfer_id,
        ticket.dst_address,
        ",".join(map(str, ticket.dst_block_ids)),
        ticket.layout_hash,
        ticket.num_tokens,
        repr(ticket.expires_at_unix_s),
        ticket.kv_device,
        ticket.num_cached_blocks,
        *_rank_parts(ticket),
    )


def _rank_parts(ticket: node_pb2.TransferTicket) -> tuple[str, ...]:
    """A tensor-parallel decode node's ranks (nothing for a TP 1 ticket, whose signed bytes
    stay what they were)."""
    if ticket.tp_size <= 1 and not ticket.ranks:
        return ()
    ranks = ";".join(
        f"{r.rank},{r.address},{r.kv_head_start},{r.kv_head_end},{r.kv_device}"
        for r in ticket.ranks
    )
    return (f"tp={ticket.tp_size}", ranks)


def issue_ticket(
    auth: ClusterAuth | None,
    timeout_s: float,
    transfer_id: str,
    dst_address: str,
    dst_block_ids: Sequence[int],
    layout_hash: str,
    num_tokens: int,
    kv_device: str,
    num_cached_blocks: int = 0,
    kv_cache_dtype: str = "",
    ranks: Sequence[node_pb2.RankEndpoint] = (),
) -> node_pb2.TransferTicket:
    """What a receiver hands the prefill node (through the router): where and into which
    blocks to send its KV (the prompt's after its first `num_cached_blocks`, which the
    receiver holds: `KVSuffix`; a tensor-parallel node: each of its `ranks`' endpoint and kv
    heads); signed (valid `timeout_s`) when there is a cluster secret (`kv_cache_dtype` only
    names a mismatch: the signed layout_hash covers it)."""
    ticket = node_pb2.TransferTicket(
        transfer_id=transfer_id,
        dst_address=dst_address,
        dst_block_ids=dst_block_ids,
        layout_hash=layout_hash,
        num_tokens=num_tokens,
        kv_device=kv_device,
        num_cached_blocks=num_cached_blocks,
        kv_cache_dtype=kv_cache_dtype,
        tp_size=len(ranks) if ranks else 0,
        ranks=ranks,
    )
    if auth is not None:
        sign_ticket(auth, ticket, timeout_s)
    return ticket


def ticket_misfit(layout: KVLayout, ticket: node_pb2.TransferTicket) -> str | None:
    """Why a sender of `layout` cannot send what `ticket` asks for, or None."""
    if not ticket.dst_address:
        return "no dst_address"
    if ticket.layout_hash != layout.layout_hash():
        dtypes = dtype_mismatch(layout.dtype, ticket.kv_cache_dtype)
        return dtypes or f"layout_hash {ticket.layout_hash!r} differs from this node's {layout}"
    if ticket.num_tokens <= 0:
        return f"num_tokens is {ticket.num_tokens}; a transfer needs at least one token"
    try:
        suffix = KVSuffix(layout.block_size, ticket.num_tokens, ticket.num_cached_blocks)
    except ValueError as error:
        return str(error)
    num_blocks = suffix.num_blocks
    if len(ticket.dst_block_ids) < num_blocks:
        return f"{len(ticket.dst_block_ids)} dst blocks for {num_blocks} blocks of KV"
    return None


def ticket_suffix(layout: KVLayout, ticket: node_pb2.TransferTicket) -> KVSuffix:
    """The part of the prompt's KV `ticket` asks for. A ticket whose held blocks make no
    sense is refused (`ticket_misfit` says why): for it, the whole prompt."""
    try:
        return KVSuffix(layout.block_size, ticket.num_tokens, ticket.num_cached_blocks)
    except ValueError:
        return KVSuffix(layout.block_size, max(1, ticket.num_tokens))


def sign_ticket(auth: ClusterAuth, ticket: node_pb2.TransferTicket, timeout_s: float) -> None:
    """Set the ticket's expiry (`timeout_s` from now) and signature, in place."""
    ticket.expires_at_unix_s = round(time.time() + timeout_s, 3)
    seal_ticket(auth, ticket)


def seal_ticket(auth: ClusterAuth, ticket: node_pb2.TransferTicket) -> None:
    """Sign `ticket` as it is, expiry included, in place: both ends of a tensor-parallel
    route derive its ticket from the signed whole and so compute the same signature
    (cache_transfer/tp/route_tickets.py)."""
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


def handshake_for(
    ticket: node_pb2.TransferTicket,
    layout: KVLayout,
    src_address: str,
    auth: ClusterAuth | None,
    kv_device: str,
    write_in_place: bool,
    timeout_s: float,
    nonce: bytes = b"",
    connection: str = "",
    encrypted: bool = False,
    heads: HeadSlice | None = None,
) -> transfer_pb2.TransferHandshake:
    """The sender's handshake for `ticket`: what the receiver checks it against, where to
    answer, whether it asks to write in place, its deadline; with a secret, proving it on
    `connection` (our transport's peer id there) in answer to the challenge's `nonce`; `heads`: the kv heads it carries from which
    rank (default: every head, TP 1)."""
    heads = heads or HeadSlice.whole(layout.num_kv_heads)
    handshake = transfer_pb2.TransferHandshake(
        protocol_version=PROTOCOL_VERSION,
        layout_hash=layout.layout_hash(),
        src_address=src_address,
        num_layers=layout.num_layers,
        num_tokens=ticket.num_tokens,
        num_blocks=layout.num_blocks_for(ticket.num_tokens) - ticket.num_cached_blocks,
        num_cached_blocks=ticket.num_cached_blocks,
        kv_device=kv_device,
        write_in_place=write_in_place,
        timeout_s=timeout_s,
        kv_cache_dtype=layout.dtype,
        tp_size=heads.tp_size,
        rank=heads.rank,
        kv_head_start=heads.kv_head_start,
        kv_head_end=heads.kv_head_end,
        encrypted=encrypted,
    )
    if auth is not None:
        handshake.proof = handshake_proof(auth, ticket, src_address, nonce, connection)
    return handshake


def handshake_proof(
    auth: ClusterAuth,
    ticket: node_pb2.TransferTicket,
    src_address: str,
    nonce: bytes,
    connection: str,
) -> bytes:
    return auth.sign(
        "kv-handshake", ticket.transfer_id, nonce, connection, src_address, ticket.layout_hash,
        ticket.num_tokens, ticket.signature,
    )  # fmt: skip


def check_handshake(
    auth: ClusterAuth,
    ticket: node_pb2.TransferTicket,
    handshake: transfer_pb2.TransferHandshake,
    nonce: bytes | None,
    connection: str,
) -> str | None:
    """None when `handshake`, received on `connection`, proves the secret in answer to the
    `nonce` this receiver issued to that connection (None: it issued none, or it was used)."""
    if not handshake.proof:
        return "the handshake carries no proof of the cluster secret"
    if nonce is None:
        return (
            "no challenge of this connection is outstanding (a handshake without a hello, or "
            "a proof used already)"
        )
    expected = handshake_proof(auth, ticket, handshake.src_address, nonce, connection)
    if not hmac.compare_digest(handshake.proof, expected):
        return (
            "the handshake's proof does not verify for this connection and its challenge (a "
            "replayed handshake, or a sender without the cluster secret)"
        )
    return None
