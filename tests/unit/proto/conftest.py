"""Shared helpers for the wire-schema tests: a message filler and an in-process gRPC server."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass

# A non-default value per scalar type, at the edge of its range where that can go wrong.
_SCALARS = {
    FieldDescriptor.TYPE_BOOL: True,
    FieldDescriptor.TYPE_UINT32: 2**32 - 1,
    FieldDescriptor.TYPE_UINT64: 2**64 - 1,
    FieldDescriptor.TYPE_INT32: -(2**31),
    FieldDescriptor.TYPE_DOUBLE: 0.1,  # not exact in float32: a double must keep it
    FieldDescriptor.TYPE_FLOAT: -1.5,
    FieldDescriptor.TYPE_BYTES: b"\x00\xff",
}


def _value(field: FieldDescriptor, index: int) -> object:
    if field.type == FieldDescriptor.TYPE_STRING:
        return f"{field.name}-{index}"
    if field.type == FieldDescriptor.TYPE_ENUM:
        return field.enum_type.values[-1].number
    return _SCALARS[field.type]


def filled_message(message_class: type[Message]) -> Message:
    """An instance with every field set to a non-default value (the first member of each oneof),
    each repeated field and map holding two entries, recursively."""
    message = message_class()
    for field in message.DESCRIPTOR.fields:
        oneof = field.containing_oneof
        if oneof is not None and oneof.fields[0].name != field.name:
            continue
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            key_field, value_field = field.message_type.fields  # a map: two entries
            entries = getattr(message, field.name)
            for i in range(2):
                key = _value(key_field, i)
                if value_field.type == FieldDescriptor.TYPE_MESSAGE:
                    value_class = GetMessageClass(value_field.message_type)
                    entries[key].CopyFrom(filled_message(value_class))
                else:
                    entries[key] = _value(value_field, i)
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            sub_class = GetMessageClass(field.message_type)
            if field.is_repeated:
                for _ in range(2):
                    getattr(message, field.name).add().CopyFrom(filled_message(sub_class))
            else:
                getattr(message, field.name).CopyFrom(filled_message(sub_class))
        elif field.is_repeated:
            getattr(message, field.name).extend(_value(field, i) for i in range(2))
        else:
            setattr(message, field.name, _value(field, 0))
    return message


@pytest.fixture
def fill() -> Callable[[type[Message]], Message]:
    return filled_message


@pytest.fixture
def serve() -> Iterator[Callable[..., grpc.Channel]]:
    """Start an in-process gRPC server with the given (add_servicer_fn, servicer) pairs
    registered on one port; returns a channel to it. Everything stops at teardown."""
    servers: list[grpc.Server] = []
    channels: list[grpc.Channel] = []

    def start(*registrations: tuple[Callable, object]) -> grpc.Channel:
        server = grpc.server(ThreadPoolExecutor(max_workers=2))
        for add_servicer, servicer in registrations:
            add_servicer(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        channels.append(grpc.insecure_channel(f"127.0.0.1:{port}"))
        return channels[-1]

    yield start
    for channel in channels:
        channel.close()
    for server in servers:
        server.stop(grace=None)
