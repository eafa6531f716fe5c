"""transfer.proto: one TransferMessage decoder reads every control message; the version rule."""

from __future__ import annotations

import pytest
from google.protobuf.message_factory import GetMessageClass

from pdserve.v1 import transfer_pb2

KINDS = list(transfer_pb2.TransferMessage.DESCRIPTOR.oneofs_by_name["kind"].fields)


def test_every_control_message_is_a_kind_of_transfer_message() -> None:
    # (KVPoolExport travels inside HandshakeAck, not as a kind of its own)
    messages = set(transfer_pb2.DESCRIPTOR.message_types_by_name) - {
        "TransferMessage",
        "KVPoolExport",
    }

    assert {field.message_type.name for field in KINDS} == messages


@pytest.mark.parametrize("kind", KINDS, ids=lambda field: field.name)
def test_one_decoder_reads_any_kind(kind, fill) -> None:
    payload = fill(GetMessageClass(kind.message_type))
    message = transfer_pb2.TransferMessage(transfer_id="t-42", seq=7, **{kind.name: payload})

    decoded = transfer_pb2.TransferMessage.FromString(message.SerializeToString())

    assert decoded.WhichOneof("kind") == kind.name
    assert getattr(decoded, kind.name) == payload
    assert (decoded.transfer_id, decoded.seq) == ("t-42", 7)


def test_a_handshake_without_a_version_never_matches_the_current_one() -> None:
    handshake = transfer_pb2.TransferHandshake.FromString(b"")

    assert handshake.protocol_version == transfer_pb2.PROTOCOL_VERSION_UNSPECIFIED == 0
    assert transfer_pb2.PROTOCOL_VERSION_CURRENT >= 1
