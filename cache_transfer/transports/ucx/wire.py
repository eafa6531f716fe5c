"""How `UcxTransport` frames messages on a UCX endpoint (both directions).

One transport message is one or two tag-matched UCX messages, tagged with the message's
sequence number on its connection, so any number of them can be in flight at once and the
receiver still takes them in the order the sender numbered them:

    tag(seq, HEAD)      preamble (header_len, payload_len: little-endian u64) + header bytes,
                        at most MAX_HEAD_BYTES; received into one reused host buffer
    tag(seq, PAYLOAD)   the payload, only when payload_len > 0: received straight into the
                        tensor the handler prepared (host or CUDA memory alike)

Message 0 of every connection is the hello: its header is the sender's transport address.
UCX reads and writes CUDA memory outside torch's stream order, so both ends first wait for
the work already queued on the current stream (`wait_for_stream`).
"""

from __future__ import annotations

import asyncio
import struct
import time

import numpy as np
import torch

PREAMBLE = struct.Struct("<QQ")  # header_len, payload_len
MAX_HEAD_BYTES = 64 << 10
MAX_HEADER_BYTES = MAX_HEAD_BYTES - PREAMBLE.size
HEAD, PAYLOAD = 0, 1
_STREAM_SPIN_S = 0.002
_STREAM_POLL_S = 0.001


def message_tag(seq: int, part: int) -> int:
    """The tag of part `part` (HEAD or PAYLOAD) of message `seq` on one connection."""
    return 2 * seq + part


def encode_head(header: bytes, payload_bytes: int) -> bytearray:
    if len(header) > MAX_HEADER_BYTES:
        raise ValueError(
            f"a {len(header)}-byte header exceeds the ucx transport's {MAX_HEADER_BYTES} bytes; "
            "headers are control messages, put bulk data in the payload"
        )
    return bytearray(PREAMBLE.pack(len(header), payload_bytes) + header)


def decode_head(head: bytearray) -> tuple[bytes, int]:
    """(header, payload_len) of a received head; ValueError when the preamble is impossible."""
    header_len, payload_bytes = PREAMBLE.unpack_from(head)
    if header_len > MAX_HEADER_BYTES:
        raise ValueError(f"a head announces a {header_len}-byte header (max {MAX_HEADER_BYTES})")
    return bytes(head[PREAMBLE.size : PREAMBLE.size + header_len]), payload_bytes


def as_ucx_buffer(tensor: torch.Tensor) -> np.ndarray | torch.Tensor:
    """What ucxx sends from or receives into: a numpy view of host memory, or the CUDA tensor
    itself (`__cuda_array_interface__`)."""
    return tensor.numpy() if tensor.device.type == "cpu" else tensor


async def wait_for_stream(tensor: torch.Tensor) -> None:
    """For a CUDA tensor: until the work queued so far on its device's current stream is done.
    Polled so the event loop keeps running: yielding at first (kernels take microseconds, and
    the loop's timers only tick in milliseconds), then every millisecond. Nothing to wait for
    on the host."""
    if tensor.device.type != "cuda":
        return
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(tensor.device))
    spin_until_s = time.perf_counter() + _STREAM_SPIN_S
    while not event.query():
        await asyncio.sleep(0 if time.perf_counter() < spin_until_s else _STREAM_POLL_S)
