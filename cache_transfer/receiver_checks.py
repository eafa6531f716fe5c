"""Every check a `KVReceiver` runs on a message from its sender, in the order they run.

A message reaches `KVReceiver.prepare` (it carries a payload, which lands only if accepted
here) or `KVReceiver.complete` (header only; a payload that landed is not checked again):

    1. unproven_sender      with a cluster secret, only the sender whose handshake proved it
                            (its proof covers the nonce this receiver challenged that
                            connection with, taken: it proves one handshake only)
       forged (the receiver's FrameSealer): that handshake's MAC under the key its proof
                            brings, every later message's under the sender's key (a payload's
                            once it landed in staging, before it is unpacked)
    2. superseded_sender    not a sender that a retried one took over from
       ─► failing 1 or 2 (or a handshake's MAC): not heard (logged, dropped); the session
       goes on. A message of the sender whose MAC fails: the session fails
       (then, header only: a drained notice after the end settles the writes in place; a
       handshake from another sender may take the session over: takeover_allowed)
    3. refusal(...)
       sender_refusal       the session is live, the handshake comes first and then everything
                            from the peer that sent it, each with the next sequence number
       by kind:
       handshake            handshake_refusal: version, layout, layers, tokens, blocks (and
                            those held here: the suffix), kv heads and rank, address, encryption
       progress             progress_refusal: computed tokens never shrink nor exceed the prompt
       layer_manifest       with a payload: payload_refusal ─► layer_refusal
                            written in place: written_layers_refusal ─► layer_refusal per layer
       first_token          first_token_refusal: once, after every layer is complete;
                            opened (FrameSealer), bounded_drafts: at most 16 drafts
       result               result_refusal: only the receiver reports success
       ─► refused: the session fails and the peer is told (a handshake: a refused ack)

The checks only read (a `ReceiverView`); the receiver acts on what they return.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

from cache_transfer.layout import HeadSlice, KVLayout, dtype_mismatch
from cache_transfer.protocol import PROTOCOL_VERSION, TransferMessage, kind_of
from cache_transfer.state import TransferState
from cache_transfer.suffix import KVSuffix
from cache_transfer.tickets import check_handshake
from pdserve.security import ClusterAuth
from pdserve.v1 import node_pb2, transfer_pb2


class ReceiverView(Protocol):
    """What the checks read of a receiver (`KVReceiver` is one)."""

    @property
    def layout(self) -> KVLayout: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def suffix(self) -> KVSuffix: ...  # what the hand-off carries (the rest is held here)
    @property
    def state(self) -> TransferState: ...
    @property
    def sender_id(self) -> str | None: ...  # the peer that handshook (None: none yet)
    @property
    def superseded(self) -> Collection[str]: ...  # senders a takeover replaced
    @property
    def expected_seq(self) -> int: ...  # the sequence number of the sender's next message
    @property
    def layer_token_end(self) -> Sequence[int]: ...  # tokens of each layer accepted so far
    @property
    def num_landing(self) -> int: ...  # payloads accepted whose bytes have not landed yet
    @property
    def num_computed_tokens(self) -> int: ...  # as the sender's last progress said
    @property
    def first_token(self) -> transfer_pb2.FirstToken | None: ...
    @property
    def in_place(self) -> bool: ...  # the sender was granted writes in place
    @property
    def heads(self) -> HeadSlice: ...  # the kv heads (and sending rank) the session carries
    @property
    def expects_first_token(self) -> bool: ...  # False: a TP route that ends with its layers
    @property
    def authenticated(self) -> bool: ...  # a cluster secret: handshakes prove it
    @property
    def requires_encryption(self) -> bool: ...  # --kv-encrypt: only encrypted transfers


@dataclass(frozen=True)
class Refusal:
    reason: str  # what does not fit (a refused handshake's ack carries it)
    error: str  # why the session fails
    of_handshake: bool = False  # the handshake does not fit: answered with a refused ack


def unproven_sender(
    r: ReceiverView,
    auth: ClusterAuth | None,
    ticket: node_pb2.TransferTicket,
    peer_id: str,
    msg: TransferMessage,
    nonce: bytes | None,
) -> str | None:
    """1. With a cluster secret: why `msg` comes from anyone but a sender that proved it (its
    handshake's proof verifies for the `nonce` this receiver challenged `peer_id` with, and
    later messages come from that same peer), or None."""
    if auth is None or r.state.finished or peer_id == r.sender_id:
        return None
    if kind_of(msg) == "handshake":  # the first, or a takeover
        return check_handshake(auth, ticket, msg.handshake, nonce, peer_id)
    return f"a {kind_of(msg)} message from a peer that proved no cluster secret"


def superseded_sender(r: ReceiverView, peer_id: str, msg: TransferMessage) -> str | None:
    """2. A message from a sender a takeover replaced (harmless): why it is dropped, or None."""
    if peer_id not in r.superseded:
        return None
    return f"a {kind_of(msg)} message from {peer_id}, which a takeover replaced"


def takeover_allowed(r: ReceiverView, peer_id: str, msg: TransferMessage) -> bool:
    """A handshake from another sender while the session still waits: the router's retry of a
    prefill node that died (or hung) after it handshook, with the same ticket (and, with a
    cluster secret, a proof step 1 checked). Allowed while no layer of the first sender is
    landing, none was written in place (its writes cannot be fenced) and no first token came:
    the new sender starts the layers over, within the deadline the first handshake started."""
    return (
        kind_of(msg) == "handshake"
        and r.sender_id is not None
        and peer_id != r.sender_id
        and not r.state.finished
        and not r.in_place
        and r.num_landing == 0
        and r.first_token is None
    )


def refusal(
    r: ReceiverView, peer_id: str, msg: TransferMessage, payload_bytes: int | None
) -> Refusal | None:
    """3. Why the session refuses `msg` (a payload of `payload_bytes` comes with it; None:
    header only), or None: it fits, and the receiver acts on it."""
    kind = kind_of(msg)
    reason = sender_refusal(r, peer_id, msg)
    if reason is None and payload_bytes is not None:
        reason = payload_refusal(r, msg, payload_bytes)
    elif reason is None and kind == "layer_manifest":
        reason = written_layers_refusal(r, msg.layer_manifest)
    elif reason is None and kind == "progress":
        reason = progress_refusal(r, msg.progress)
    elif reason is None and kind == "handshake":
        reason = handshake_refusal(r, msg.handshake)
        if reason is not None:
            error = f"refused the handshake from {peer_id}: {reason}"
            return Refusal(reason, error, of_handshake=True)
    elif reason is None:  # a first token or a result: refused in words of their own
        own = first_token_refusal(r) if kind == "first_token" else result_refusal(msg.result)
        return None if own is None else Refusal(own, own)
    if reason is None:
        return None
    return Refusal(reason, f"refused a message from {peer_id}: {reason}")


def sender_refusal(r: ReceiverView, peer_id: str, msg: TransferMessage) -> str | None:
    """Why this message may not come from `peer_id` now, or None."""
    kind = kind_of(msg)
    if r.state.finished:
        return f"the session is already {r.state.name}"
    if r.sender_id is None and kind not in ("handshake", "result"):
        return f"{kind} before the handshake"
    if r.sender_id is not None and peer_id != r.sender_id:
        return f"not from the peer that handshook ({r.sender_id})"
    if kind == "handshake" and r.sender_id is not None:
        return "a second handshake"
    if msg.seq != r.expected_seq:
        return f"message seq {msg.seq} out of order: expected {r.expected_seq}"
    return None


def handshake_refusal(r: ReceiverView, handshake: transfer_pb2.TransferHandshake) -> str | None:
    """The handshake against the ticket: the same protocol, layout and prompt."""
    expected = {
        "protocol_version": PROTOCOL_VERSION,
        "layout_hash": r.layout.layout_hash(),
        "num_layers": r.layout.num_layers,
        "num_tokens": r.num_tokens,
        "num_blocks": r.suffix.num_blocks,
        "num_cached_blocks": r.suffix.num_cached_blocks,
    }
    for field, want in expected.items():
        got = getattr(handshake, field)
        if got != want:
            dtypes = dtype_mismatch(handshake.kv_cache_dtype, r.layout.dtype)
            return dtypes or f"{field} is {got!r}, this receiver expects {want!r}"
    sent = HeadSlice(  # unset (proto3 zeros): a TP 1 sender, every head of the layout
        handshake.kv_head_start,
        handshake.kv_head_end or handshake.kv_head_start + r.layout.num_kv_heads,
        handshake.tp_size or 1,
        handshake.rank,
    )
    if sent != r.heads:
        return f"the sender carries {sent.describe()}; this receiver takes {r.heads.describe()}"
    if not handshake.src_address:
        return "no src_address to reply to"
    if r.requires_encryption and not handshake.encrypted:
        return "this receiver takes encrypted KV frames only (--kv-encrypt on both nodes)"
    if handshake.encrypted and not r.authenticated:
        return "encrypted KV frames need a cluster secret (the key comes from it)"
    return None


def progress_refusal(r: ReceiverView, progress: transfer_pb2.Progress) -> str | None:
    """The sender's engine progressed: its computed tokens of the prompt only grow, up to the
    prompt's length, and none come after the first token."""
    if r.first_token is not None:
        return "progress after the first token"
    if not r.num_computed_tokens <= progress.num_computed_tokens <= r.num_tokens:
        return (
            f"progress of {progress.num_computed_tokens} computed tokens after "
            f"{r.num_computed_tokens}, of a {r.num_tokens}-token prompt"
        )
    return None


def payload_refusal(r: ReceiverView, msg: TransferMessage, payload_bytes: int) -> str | None:
    """A payload comes only with a layer manifest of a layer not written in place."""
    if kind_of(msg) != "layer_manifest":
        return f"a {kind_of(msg)} message must not carry a payload"
    if msg.layer_manifest.written_in_place or msg.layer_manifest.more_layer_ids:
        return "a layer written in place must not carry a payload"
    return layer_refusal(r, msg.layer_manifest, payload_bytes)


def written_layers_refusal(r: ReceiverView, manifest: transfer_pb2.LayerManifest) -> str | None:
    """A manifest without payload: layers the granted sender wrote in place (its layer and
    `more_layer_ids`, each once, one span each)."""
    if not manifest.written_in_place:
        return "a layer manifest without its payload"
    if not r.in_place:
        return "a layer written in place, which this receiver did not grant"
    layer_ids = [manifest.layer_idx, *manifest.more_layer_ids]
    if len(set(layer_ids)) != len(layer_ids):
        return f"layers {layer_ids[:8]}... announced twice in one manifest"
    for layer_idx in layer_ids:
        reason = layer_refusal(r, manifest, manifest.num_bytes, layer_idx)
        if reason is not None:
            return reason
    return None


def layer_refusal(
    r: ReceiverView,
    manifest: transfer_pb2.LayerManifest,
    payload_bytes: int,
    layer_idx: int | None = None,  # that layer of the manifest (default: its layer_idx)
) -> str | None:
    """The manifest's next span of one layer: after what was received, within the ticket's
    tokens, the exact block range and byte count, and before the first token."""
    layer_idx = manifest.layer_idx if layer_idx is None else layer_idx
    token_end, layout = manifest.token_end, r.layout
    if r.first_token is not None:
        return "a layer after the first token"
    if layer_idx >= layout.num_layers:
        return f"layer index {layer_idx} outside [0, {layout.num_layers})"
    prev_end = r.layer_token_end[layer_idx]
    if not prev_end < token_end <= r.num_tokens:
        return (
            f"layer {layer_idx}: token_end {token_end} must exceed {prev_end} (already "
            f"received) and not exceed {r.num_tokens}"
        )
    block_offset, block_end = r.suffix.span(prev_end, token_end)
    num_blocks = block_end - block_offset
    if (manifest.block_offset, manifest.num_blocks) != (block_offset, num_blocks):
        return (
            f"layer {layer_idx}: blocks [{manifest.block_offset}, +{manifest.num_blocks}) "
            f"for tokens [{prev_end}, {token_end}), expected [{block_offset}, +{num_blocks})"
        )
    num_bytes = layout.layer_bytes(num_blocks)
    if manifest.num_bytes != num_bytes or payload_bytes != num_bytes:
        return (
            f"layer {layer_idx}: {payload_bytes} payload bytes (manifest says "
            f"{manifest.num_bytes}) for {num_blocks} blocks of {num_bytes} bytes"
        )
    return None


MAX_DRAFT_TOKENS = 16  # SpeculativeConfig.num_speculative_tokens' bound


def first_token_refusal(r: ReceiverView) -> str | None:
    """The first token comes once, after every layer's KV of every token, on the session
    that expects it (a tensor-parallel hand-off's other routes end with their layers)."""
    if not r.expects_first_token:
        return f"refused a first token: this session carries {r.heads.describe()} only"
    if r.first_token is not None:
        return "refused a second first token"
    missing = [i for i, end in enumerate(r.layer_token_end) if end != r.num_tokens]
    if missing:
        return f"refused the first token: layers {missing[:8]} are incomplete"
    return None


def bounded_drafts(first: transfer_pb2.FirstToken) -> transfer_pb2.FirstToken:
    """The first token as sent (opened, when sealed: its drafts too), with at most
    `MAX_DRAFT_TOKENS` drafts (speculative decoding); ValueError otherwise."""
    if len(first.draft_token_ids) > MAX_DRAFT_TOKENS:
        num = len(first.draft_token_ids)
        raise ValueError(f"{num} draft tokens, at most {MAX_DRAFT_TOKENS}")
    return first


def result_refusal(result: transfer_pb2.TransferResult) -> str | None:
    """The sender may end the transfer (a failed result), never report its success."""
    if result.ok:
        return "refused the sender's result: only the receiver reports success"
    return None
