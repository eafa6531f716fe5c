"""`UcxOutbound`: this node's connection to one peer's listener (framing in wire.py).

    UcxOutbound(peer)          connects in the background; its hello (message 0) names it
    submit(messages)           numbers the messages at once (call order = arrival order) and
                               sends them (one head, a payload each) once connected: any
                               number in flight, so layers of several transfers share the link
    a UCX error (peer died, refused, endpoint error) ──► failed: the endpoint is aborted and
                               every message in flight raises TransportError
    close()                    flushes briefly, then aborts: UCX cancels what is in flight

A message's send task owns its buffers until UCX is done with them, even when the caller
stops waiting: a caller's timeout never frees memory UCX still reads, nor leaves a gap in the
numbering.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
from collections.abc import Sequence

import torch

from cache_transfer.transports.base import Message, TransportError
from cache_transfer.transports.cuda_waits import wait_for_stream
from cache_transfer.transports.ucx.runtime import UCXError, ucxx
from cache_transfer.transports.ucx.wire import (
    DEVICE_WAIT_TIMEOUT_S,
    HEAD,
    PAYLOAD,
    as_ucx_buffer,
    encode_head,
    message_tag,
)

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0  # one attempt (ucxx's peer-info exchange; its listener's is 5 s too)
# A connect that times out is tried again, once, if the peer still listens: under CPU load about
# 1 in 100 ucxx connects on loopback stalls in the peer-info exchange until the listener's side
# gives up (2 spinners on 2 cores: 3 of 250 rounds), and a fresh attempt goes through. A dead
# peer's connect fails at once or, now and then, also by timing out (ucxx waits out its exchange
# though UCX saw the refusal): a plain TCP connect to its port (the ucx listener over tcp)
# tells the two apart, so a dead peer still fails after one attempt. (Where UCX listens
# through RDMA CM, nothing answers TCP there, and no attempt is retried.)
CONNECT_ATTEMPTS = 2
LISTENING_PROBE_S = 3.0  # generous: an event loop under load answers late
_ATTEMPT_S = CONNECT_TIMEOUT_S + 1.0  # our bound on one attempt: ucxx's own timeout fires first
CONNECT_BOUND_S = CONNECT_ATTEMPTS * _ATTEMPT_S + LISTENING_PROBE_S  # the longest _connect runs
_CLOSE_FLUSH_S = 1.0  # how long close() lets queued messages (failure notices) go out


class UcxOutbound:
    def __init__(self, local_address: str, peer_address: str, host: str, port: int) -> None:
        """Connect to the listener at `host:port` (`peer_address` names it in errors). Call
        inside the transport's event loop. The hello names this connection:
        `name` = "<local_address>#<random>", the peer's peer_id for what it carries."""
        self.peer_address = peer_address
        self.name = f"{local_address}#{secrets.token_hex(8)}"
        self.error: str | None = None
        self._loop = asyncio.get_running_loop()
        self._seq = itertools.count()
        self._inflight: set[asyncio.Task[None]] = set()
        self._endpoint: ucxx.Endpoint | None = None
        self._connecting = self._loop.create_task(self._connect(host, port))
        self._connecting.add_done_callback(_retrieve)
        self.submit([(self.name.encode(), None)])  # the hello

    @property
    def failed(self) -> bool:
        return self.error is not None

    def submit(self, messages: Sequence[Message]) -> asyncio.Task[None]:
        """Send messages (one head) in the background; the task raises TransportError on
        failure. ValueError at once, nothing numbered, when their head is too large."""
        head = encode_head([(header, _num_bytes(payload)) for header, payload in messages])
        first = next(self._seq)
        for _ in range(len(messages) - 1):  # the numbers first .. first + len - 1
            next(self._seq)
        task = self._loop.create_task(self._deliver(first, head, list(messages)))
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)
        task.add_done_callback(_retrieve)
        return task

    async def close(self) -> None:
        """Let messages in flight finish for up to a second, then abort the endpoint."""
        if self._inflight and not self.failed:
            await asyncio.wait(set(self._inflight), timeout=_CLOSE_FLUSH_S)
        self._fail("the transport closed")
        # A connect under way is let finish, not cut short: cancelled mid-handshake, its UCX
        # endpoint (and the listener's half of the handshake) outlive it, and UCX shutting down
        # under them (the last transport closing) crashed the process. It ends within
        # its attempts' timeouts, and _connect aborts the endpoint it gets, this connection failed.
        await asyncio.wait({self._connecting}, timeout=CONNECT_BOUND_S + 1.0)
        self._connecting.cancel()  # only a connect past its own wait_for is still running
        if self._inflight:  # UCX cancelled their requests: they end with TransportError
            await asyncio.wait(set(self._inflight), timeout=_CLOSE_FLUSH_S)

    async def _connect(self, host: str, port: int) -> ucxx.Endpoint:
        for attempt in range(1, CONNECT_ATTEMPTS + 1):
            try:
                endpoint = await asyncio.wait_for(
                    ucxx.create_endpoint(host, port, connect_timeout=CONNECT_TIMEOUT_S),
                    _ATTEMPT_S,  # ucxx's own timeout first: it cleans up after it
                )
                break
            except TimeoutError as error:
                if attempt == CONNECT_ATTEMPTS or self.failed or not await _listening(host, port):
                    raise self._fail(f"cannot connect (attempt {attempt}): {error!r}") from None
                logger.info("ucx connection to %s: attempt %d timed out, trying again",
                            self.peer_address, attempt)  # fmt: skip
            except (UCXError, OSError, RuntimeError) as error:
                raise self._fail(f"cannot connect: {error!r}") from None
        if self.failed:  # closed while connecting
            endpoint.abort()
            raise self._fail("closed while connecting")
        self._endpoint = endpoint
        return endpoint

    async def _deliver(self, seq: int, head: bytearray, messages: list[Message]) -> None:
        await asyncio.wait({self._connecting})
        by_device = {p.device: p for _, p in messages if p is not None}
        for on_device in by_device.values():  # one wait per device covers all its payloads
            await wait_for_stream(on_device, DEVICE_WAIT_TIMEOUT_S)
        if self.failed or self._endpoint is None or self._endpoint.closed:
            raise self._fail("not connected")
        sends = [self._endpoint.send(head, tag=message_tag(seq, HEAD))]
        for i, (_, payload) in enumerate(messages):
            if payload is not None and payload.numel():
                buffer = as_ucx_buffer(payload)
                sends.append(self._endpoint.send(buffer, tag=message_tag(seq + i, PAYLOAD)))
        # Every send runs to the end, even when one fails, so no buffer is freed under UCX.
        results = await asyncio.gather(*sends, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:  # UCXError, or ucxx tripping over an endpoint aborted under it
            raise self._fail(f"send failed: {errors[0]!r}") from errors[0]

    def _fail(self, reason: str) -> TransportError:
        """Mark the connection broken (once) and abort its endpoint."""
        if self.error is None:
            self.error = reason
            logger.info("ucx connection to %s: %s", self.peer_address, reason)
            if self._endpoint is not None:
                self._endpoint.abort()
        return TransportError(f"ucx connection to {self.peer_address} failed: {self.error}")


async def _listening(host: str, port: int) -> bool:
    """Whether something accepts TCP connections at host:port (closed again at once)."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), LISTENING_PROBE_S)
    except (OSError, TimeoutError):
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True


def _num_bytes(payload: torch.Tensor | None) -> int:
    return 0 if payload is None else payload.numel()


def _retrieve(task: asyncio.Task[object]) -> None:
    """Mark a background task's exception as seen (callers that gave up never read it)."""
    if not task.cancelled():
        task.exception()
