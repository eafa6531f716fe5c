"""Every message of the three wire schemas: round trip, and the project's naming conventions."""

from __future__ import annotations

import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message_factory import GetMessageClass

from pdserve.v1 import generation_pb2, node_pb2, transfer_pb2

FILES = (generation_pb2.DESCRIPTOR, node_pb2.DESCRIPTOR, transfer_pb2.DESCRIPTOR)
MESSAGES: list[Descriptor] = [m for f in FILES for m in f.message_types_by_name.values()]
FIELDS: list[FieldDescriptor] = [field for m in MESSAGES for field in m.fields]

UNSIGNED = {FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_UINT64}


def test_the_files_share_one_package() -> None:
    assert {f.package for f in FILES} == {"pdserve.v1"}
    assert {f.name for f in FILES} == {
        "pdserve/v1/generation.proto",
        "pdserve/v1/node.proto",
        "pdserve/v1/transfer.proto",
    }


@pytest.mark.parametrize("descriptor", MESSAGES, ids=lambda d: d.full_name)
def test_every_message_round_trips_with_every_field_set(descriptor: Descriptor, fill) -> None:
    message_class = GetMessageClass(descriptor)
    message = fill(message_class)
    num_oneof_members_unset = sum(len(oneof.fields) - 1 for oneof in descriptor.oneofs)
    assert len(message.ListFields()) == len(descriptor.fields) - num_oneof_members_unset

    parsed = message_class.FromString(message.SerializeToString())

    assert parsed == message
    assert parsed.ListFields() == message.ListFields()


def _convention_violation(field: FieldDescriptor) -> str | None:
    """Why a scalar field's type contradicts its name (ARCHITECTURE.md conventions), if it does."""
    name = field.name
    if field.type == FieldDescriptor.TYPE_MESSAGE:  # e.g. GenerateRequest.prompt_token_ids
        return None
    if name.endswith("_s") and field.type != FieldDescriptor.TYPE_DOUBLE:
        return f"{field.full_name}: seconds must be double"
    counts = name.startswith("num_") or name.endswith(("_tokens", "_bytes", "_len", "_size"))
    if counts and field.type not in UNSIGNED:
        return f"{field.full_name}: counts must be unsigned"
    ids = name.endswith(("token_id", "token_ids", "block_ids")) or name == "ids"
    if ids and field.type != FieldDescriptor.TYPE_UINT32:
        return f"{field.full_name}: token and block ids must be uint32"
    strings = ("request_id", "transfer_id", "finish_reason", "layout_hash")
    if name in strings and field.type != FieldDescriptor.TYPE_STRING:
        return f"{field.full_name}: must be a string"
    return None


def test_field_types_follow_the_naming_conventions() -> None:
    assert len(FIELDS) > 100
    assert [v for field in FIELDS if (v := _convention_violation(field))] == []
