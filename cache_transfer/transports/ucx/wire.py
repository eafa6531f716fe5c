"""How `UcxTransport` frames messages on a UCX endpoint (both directions).

Every transport message has a sequence number on its connection, and its parts are
tag-matched UCX messages tagged with it, so any number of them can be in flight at once and
the receiver still takes them in the order the sender numbered them. One head carries one or
several messages (`send_many`: numbers seq .. seq + count - 1):

    tag(seq, HEAD)         count (little-endian u64), then per message a preamble
                           (header_len, payload_len: u64) + header bytes; at most
                           MAX_HEAD_BYTES, received into one reused host buffer
    tag(seq + i, PAYLOAD)  message i's payload, only when its payload_len > 0: received
                           straight into the tensor the handler prepared (host or CUDA memory)

Message 0 of every connection is the hello: its header is the sender's transport address.
UCX reads and writes CUDA memory outside torch's stream order, so both ends first wait for
the work already queued on the current stream (`cuda_waits.wait_for_stream`, GIL-free), for
at most DEVICE_WAIT_TIMEOUT_S: a stream that has not drained by then is hung, and the message
fails (a receiving connection then drops every later one; a send fails to its caller).
"""

from __future__ import annotations

import struct

import numpy as np
import torch

COUNT = struct.Struct("<Q")  # messages in one head
PREAMBLE = struct.Struct("<QQ")  # header_len, payload_len
MAX_HEAD_BYTES = 64 << 10
HEAD, PAYLOAD = 0, 1
DEVICE_WAIT_TIMEOUT_S = 120.0  # the longest wait for queued CUDA work before a UCX read/write


def message_tag(seq: int, part: int) -> int:
    """The tag of part `part` (HEAD or PAYLOAD) of message `seq` on one connection."""
    return 2 * seq + part


def encode_head(entries: list[tuple[bytes, int]]) -> bytearray:
    """One head for `entries` of (header, payload_len); ValueError when it exceeds
    MAX_HEAD_BYTES."""
    head = bytearray(COUNT.pack(len(entries)))
    for header, payload_bytes in entries:
        head += PREAMBLE.pack(len(header), payload_bytes) + header
    if len(head) > MAX_HEAD_BYTES:
        raise ValueError(
            f"a {len(head)}-byte message head exceeds the ucx transport's {MAX_HEAD_BYTES} "
            "bytes; headers are control messages, put bulk data in the payload (or send fewer "
            "messages at once)"
        )
    return head


def decode_head(head: bytearray) -> list[tuple[bytes, int]]:
    """The (header, payload_len) entries of a received head; ValueError when it is impossible."""
    (count,) = COUNT.unpack_from(head)
    if not 0 < count <= (MAX_HEAD_BYTES - COUNT.size) // PREAMBLE.size:
        raise ValueError(f"a head announces {count} messages")
    entries, offset = [], COUNT.size
    for _ in range(count):
        if offset + PREAMBLE.size > MAX_HEAD_BYTES:
            raise ValueError("a head's messages overrun it")
        header_len, payload_bytes = PREAMBLE.unpack_from(head, offset)
        offset += PREAMBLE.size
        if header_len > MAX_HEAD_BYTES - offset:
            raise ValueError(f"a head announces a {header_len}-byte header past its end")
        entries.append((bytes(head[offset : offset + header_len]), payload_bytes))
        offset += header_len
    return entries


def as_ucx_buffer(tensor: torch.Tensor) -> np.ndarray | torch.Tensor:
    """What ucxx sends from or receives into: a numpy view of host memory, or the CUDA tensor
    itself (`__cuda_array_interface__`)."""
    return tensor.numpy() if tensor.device.type == "cpu" else tensor
