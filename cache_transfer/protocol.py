"""The control messages of `transfer.proto`, as transport headers.

Every header is one serialized `TransferMessage` envelope: transfer id, a per-sender sequence
number (0, 1, 2, ... per transfer and direction) and one kind of message.
"""

from __future__ import annotations

from google.protobuf.message import DecodeError

from pdserve.v1 import transfer_pb2

PROTOCOL_VERSION: int = transfer_pb2.PROTOCOL_VERSION_CURRENT

TransferMessage = transfer_pb2.TransferMessage
# The body of one kind of message (which one: the keyword it is passed by, e.g. `handshake=`).
MessageBody = (
    transfer_pb2.TransferHandshake
    | transfer_pb2.HandshakeAck
    | transfer_pb2.LayerManifest
    | transfer_pb2.FirstToken
    | transfer_pb2.TransferResult
    | transfer_pb2.TransferHello
    | transfer_pb2.HandshakeChallenge
    | transfer_pb2.Progress
)

# Which end of a transfer reads each kind ("result" travels both ways).
TO_RECEIVER_KINDS = frozenset(
    {"hello", "handshake", "progress", "layer_manifest", "first_token", "result"}
)
TO_SENDER_KINDS = frozenset({"challenge", "handshake_ack", "result"})
KINDS = TO_RECEIVER_KINDS | TO_SENDER_KINDS


class ProtocolError(ValueError):
    """A header that is not a well-formed TransferMessage."""


def encode(transfer_id: str, seq: int, **kind: MessageBody) -> bytes:
    """Serialize an envelope carrying exactly one kind, e.g. `handshake=TransferHandshake(...)`."""
    if len(kind) != 1:
        raise ValueError(f"a TransferMessage carries exactly one kind, got {sorted(kind)}")
    ((name, body),) = kind.items()
    if name not in KINDS:
        raise ValueError(f"a TransferMessage has no kind {name!r}")
    msg = TransferMessage(transfer_id=transfer_id, seq=seq)
    getattr(msg, name).CopyFrom(body)
    return msg.SerializeToString()


def decode(header: bytes) -> TransferMessage:
    """Parse a header; raise ProtocolError when it is not a TransferMessage with an id and kind."""
    msg = TransferMessage()
    try:
        msg.ParseFromString(header)
    except DecodeError as e:
        raise ProtocolError(f"undecodable transfer header ({len(header)} bytes): {e}") from e
    if not msg.transfer_id or msg.WhichOneof("kind") is None:
        raise ProtocolError("transfer header lacks a transfer_id or a message kind")
    return msg


def kind_of(msg: TransferMessage) -> str:
    return msg.WhichOneof("kind") or ""
