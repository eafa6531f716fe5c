"""`TcpTransport`: host-memory transport on pyzmq (asyncio).

    peer DEALER ──[header]──────────────────────────► our ROUTER (bound at `address`) ──► handler
               ──[header, payload, header, payload...]─┘  (send_many: one zmq message; an
                                                          empty payload frame: none)
    our DEALER per peer address (created on first send, reused) ──► peer ROUTER
    (a peer not reached within CONNECT_TIMEOUT_S: the send fails, the DEALER is dropped)

The ROUTER prefixes each message with the sending DEALER's routing id, which becomes the
`peer_id` handlers see. zmq multipart messages are atomic: all frames arrive or none do.
Payloads of at least `ZERO_COPY_MIN_BYTES` in all are sent without a copy (zmq frames over the
tensors' memory) and the send waits on zmq's trackers until libzmq has released the buffers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Sequence

import numpy as np
import torch
import zmq
import zmq.asyncio

from cache_transfer.transports.base import (
    KVTransport,
    Message,
    TransportBindError,
    TransportError,
    TransportHandler,
    check_messages,
    dispatch_message,
)
from pdserve.net import bracket, dial_host

logger = logging.getLogger(__name__)

ZERO_COPY_MIN_BYTES = 64 * 1024  # below this a copy is cheaper than tracking the buffer
_HEARTBEAT_IVL_MS = 2000  # zmq pings idle connections; a silent peer is dropped after:
_HEARTBEAT_TIMEOUT_MS = 6000
_TRACKER_POLL_MAX_S = 0.0005
_MAX_REPLY_BYTES = 1 << 20  # what a peer may send back on our outgoing connection (headers)
_CLOSE_LINGER_MS = 1000  # how long closed connections keep delivering what was queued
CONNECT_TIMEOUT_S = 5.0  # a peer never reached: its first send fails after this (as ucx's)


class TcpTransport(KVTransport):
    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
    ):
        """Bind a listener on `host:port` (`port=0`: a free port). Peers are told
        `advertise_host` (default: `host`, or this machine's address when `host` is 0.0.0.0).
        A send to a peer that has not been reached waits at most `connect_timeout_s` for it."""
        # The process-wide context: never terminated, so a transport left unclosed cannot
        # block the interpreter in Context.term() when it is garbage collected.
        self._ctx = zmq.asyncio.Context.instance()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.ipv6 = ":" in host
        try:  # libzmq sets SO_REUSEADDR: a killed node's port in TIME_WAIT binds at once
            self._router.bind(f"tcp://{bracket(host)}:{port or '*'}")
        except zmq.ZMQError as error:
            self._router.close(linger=0)
            raise TransportBindError(
                f"cannot listen for KV on tcp://{bracket(host)}:{port}: {error}"
            ) from None
        bound = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        bound_port = int(bound.rsplit(":", 1)[1])
        self._address = f"tcp://{bracket(advertise_host or dial_host(host))}:{bound_port}"
        self._routing_id = f"{self._address}#{secrets.token_hex(8)}".encode()
        self._peers: dict[str, zmq.asyncio.Socket] = {}
        self._connected: set[str] = set()  # peers a send reached (no connect timeout since)
        self._connect_timeout_s = connect_timeout_s
        self._handler: TransportHandler | None = None
        self._recv_task: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def address(self) -> str:
        return self._address

    def start(self, handler: TransportHandler) -> None:
        if self._handler is not None:
            raise RuntimeError(f"transport {self._address} was already started")
        self._handler = handler
        self._recv_task = asyncio.get_running_loop().create_task(self._recv_loop())

    async def send_many(self, peer_address: str, messages: Sequence[Message]) -> None:
        sizes = check_messages(messages)
        for _, payload in messages:
            if payload is not None and payload.device.type != "cpu":
                raise ValueError(f"tcp carries host memory; a payload is on {payload.device}")
        if self._closed:
            raise TransportError(f"transport {self._address} is closed")
        sock = self._peer_socket(peer_address)
        zero_copy = sum(sizes) >= ZERO_COPY_MIN_BYTES
        frames, trackers = _frames(messages, zero_copy)
        try:
            if peer_address in self._connected:
                await sock.send_multipart(frames, copy=not zero_copy)
            else:
                await self._connect_and_send(peer_address, sock, frames, zero_copy)
            del frames  # a zmq.Frame holds its buffer too: only libzmq may, from here on
            for tracker in trackers:
                await self._wait_released(tracker)
        except zmq.ZMQError as e:
            raise TransportError(f"send to {peer_address} failed: {e}") from e
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if (self._closed or sock.closed) and task is not None and not task.cancelling():
                # close() (or a failed connect) cancelled the socket's send, not our caller
                closed = f"the connection to {peer_address} closed during a send"
                raise TransportError(closed) from None
            raise

    async def _connect_and_send(
        self, peer_address: str, sock: zmq.asyncio.Socket, frames: list[object], zero_copy: bool
    ) -> None:
        """A send to a peer not reached yet: it waits for the connection (IMMEDIATE), for at
        most `connect_timeout_s`; then the socket is dropped (a later send connects afresh) and
        TransportError says so."""
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                await sock.send_multipart(frames, copy=not zero_copy)
        except TimeoutError:
            if self._peers.get(peer_address) is sock:
                del self._peers[peer_address]
            sock.close(linger=0)
            raise TransportError(
                f"could not connect to {peer_address} within {self._connect_timeout_s:g} s"
            ) from None
        self._connected.add(peer_address)

    def connection_id(self, peer_address: str) -> str:
        return self._routing_id.decode()

    def limit_inbound(self, max_frame_bytes: int) -> None:
        """zmq MAXMSGSIZE: libzmq drops the connection of a peer whose frame header announces
        more, before allocating for it (a 1.5 GiB frame costs nothing)."""
        self._router.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
        # libzmq copies a listener's options when it binds: rebind the same endpoint to apply it
        endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._router.unbind(endpoint)
        for attempt in range(200):  # libzmq closes the old listener on its I/O thread
            try:
                self._router.bind(endpoint)
                return
            except zmq.ZMQError:
                if attempt == 199:
                    raise
                time.sleep(0.005)

    def buffer_device(self, cache_device: torch.device) -> torch.device:
        return torch.device("cpu")

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._recv_task is not None:
            self._recv_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._recv_task
        for sock in self._peers.values():  # flush queued control messages in the background
            sock.close(linger=_CLOSE_LINGER_MS)
        self._peers.clear()
        self._router.close(linger=0)

    def _peer_socket(self, peer_address: str) -> zmq.asyncio.Socket:
        sock = self._peers.get(peer_address)
        if sock is None:
            if not peer_address.startswith("tcp://"):
                raise TransportError(f"tcp transport cannot reach {peer_address!r}")
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.ROUTING_ID, self._routing_id)
            sock.setsockopt(zmq.IMMEDIATE, 1)  # queue only on live connections
            sock.setsockopt(zmq.MAXMSGSIZE, _MAX_REPLY_BYTES)  # peers reply with headers only
            sock.setsockopt(zmq.HEARTBEAT_IVL, _HEARTBEAT_IVL_MS)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, _HEARTBEAT_TIMEOUT_MS)
            sock.ipv6 = peer_address.startswith("tcp://[")
            sock.connect(peer_address)
            self._peers[peer_address] = sock
        return sock

    async def _wait_released(self, tracker: zmq.MessageTracker) -> None:
        """Until libzmq no longer references the payload (polled: its signal is a thread
        event, not an awaitable)."""
        delay_s = 0.0
        while not tracker.done:
            if self._closed:
                raise TransportError(f"transport {self._address} closed during a send")
            await asyncio.sleep(delay_s)
            delay_s = min(max(2 * delay_s, 50e-6), _TRACKER_POLL_MAX_S)

    async def _recv_loop(self) -> None:
        assert self._handler is not None
        while True:
            try:
                frames = await self._router.recv_multipart(copy=False)
            except zmq.ZMQError:
                if self._closed:
                    return
                logger.exception("tcp transport %s: receive failed", self._address)
                continue
            if len(frames) < 2 or (len(frames) > 2 and len(frames) % 2 == 0):
                logger.warning(
                    "tcp transport %s: dropped a %d-frame message", self._address, len(frames)
                )
                continue
            peer_id = frames[0].bytes.decode(errors="replace")
            for i in range(1, len(frames), 2):  # [header] or [header, payload]...
                self._dispatch(peer_id, frames[i], frames[i + 1] if i + 1 < len(frames) else None)

    def _dispatch(self, peer_id: str, header: zmq.Frame, payload_frame: zmq.Frame | None) -> None:
        assert self._handler is not None
        payload = None if payload_frame is None else payload_frame.buffer

        def fill(dst: torch.Tensor) -> None:
            assert payload is not None  # (filled only for a message with a payload)
            np.copyto(dst.numpy(), np.frombuffer(payload, dtype=np.uint8))

        num_bytes = 0 if payload is None else payload.nbytes
        dispatch_message(self._handler, peer_id, header.bytes, num_bytes, fill)


def _frames(
    messages: Sequence[Message], zero_copy: bool
) -> tuple[list[object], list[zmq.MessageTracker]]:
    """The zmq frames of `messages` ([header] alone, else [header, payload or b""]...) and,
    when `zero_copy`, the trackers of the frames over the payloads' memory."""
    frames: list[object] = []
    trackers: list[zmq.MessageTracker] = []
    for header, payload in messages:
        frames.append(header)
        if payload is None:
            if len(messages) > 1:
                frames.append(b"")  # no payload
        elif zero_copy:  # a frame over the tensor's memory, released when libzmq is done
            frame = zmq.Frame(payload.numpy(), copy=False, track=True)
            frames.append(frame)
            trackers.append(frame.tracker)
        else:
            frames.append(payload.numpy())
    return frames, trackers
