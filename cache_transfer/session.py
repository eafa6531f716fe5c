"""`TransferSession`: what the sender and receiver of one KV hand-off share.

    BOOTSTRAPPING ─► WAITING ─► TRANSFERRING ─► SUCCESS
          └────────────┴─────────────┴────────► FAILED  (refusal, no progress, ceiling, abort,
                                                         cancel, lost peer)

Two timers end a session that does not finish, whether or not anyone waits on it:

- no progress: `timeout_s` without a message moving (`touch()`: the receiver's accepted
  messages; the sender's sends and the ack). A prefill node that keeps computing (this prompt,
  or the prompts queued ahead of it) says so (`Progress` messages), so a long prompt or a
  backlog never fails a hand-off; a stalled one fails within `timeout_s`.
- the ceiling: `ceiling_s` from the session's creation (`set_ceiling` moves it), however it
  progresses: what bounds a peer that keeps saying it progresses.

`start()` marks when the prefill started (`elapsed_s`: the hand-off's own time, not the
queue's). Outgoing messages carry this side's sequence numbers; incoming ones must carry the
peer's next number, so a lost, repeated or injected message fails the transfer. With a cluster
secret, once the challenge gave the transfer its `FrameKey`, every message (progress included)
carries its MAC (`FrameSealer`, which the session owns: `self.frames`); the hello and the
challenge before it are neither numbered nor MACed. Log lines carry the request's id
(`log_id`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import torch

from cache_transfer import protocol
from cache_transfer.frame_auth.frame_key import TO_RECEIVER
from cache_transfer.frame_auth.frame_sealer import FrameSealer
from cache_transfer.protocol import MessageBody, TransferMessage
from cache_transfer.state import TransferState
from cache_transfer.transports.base import KVTransport, TransportError
from pdserve.v1 import transfer_pb2

logger = logging.getLogger(__name__)

NOTIFY_TIMEOUT_S = 1.0  # telling the peer about a failure is best effort, bounded by this

# one message to send: its payload (None: header only), and its kind, e.g. {"handshake": ...}
Outgoing = tuple[torch.Tensor | None, dict[str, MessageBody]]


class TransferSession:
    role = "session"
    outgoing = TO_RECEIVER  # the direction of what this side sends (frame_key)

    def __init__(
        self,
        transport: KVTransport,
        transfer_id: str,
        timeout_s: float,
        ceiling_s: float | None = None,
        log_id: str = "",
    ) -> None:
        """`timeout_s`: the no-progress timeout; `ceiling_s` (default `timeout_s`): the longest
        the session may take from now; `log_id`: the request id its log lines carry."""
        if not transfer_id:
            raise ValueError("transfer_id must be a non-empty string")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        ceiling_s = timeout_s if ceiling_s is None else ceiling_s
        if not ceiling_s > 0:
            raise ValueError(f"ceiling_s must be > 0, got {ceiling_s}")
        self.transfer_id = transfer_id
        self.timeout_s = timeout_s
        self.log_id = log_id
        self.state = TransferState.BOOTSTRAPPING
        self.error: str | None = None
        self._transport = transport
        self._peer_address: str | None = None
        self._send_seq = 0
        self._recv_seq = 0
        self._loop = asyncio.get_running_loop()
        now = self._loop.time()
        self._start_s = now
        self.started = False
        self._done = asyncio.Event()
        self._last_progress_s = now
        self._idle_timer = self._loop.call_later(timeout_s, self._on_idle_timer)
        self.ceiling_s = ceiling_s
        self._ceiling_at = now + ceiling_s
        self._ceiling_timer = self._loop.call_later(ceiling_s, self._on_ceiling)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._finish_callbacks: list[Callable[[TransferSession], None]] = []
        self.frames = FrameSealer(self.outgoing)  # MACs, once the transfer has a FrameKey

    @property
    def finished(self) -> bool:
        return self.state.finished

    @property
    def elapsed_s(self) -> float:
        """Since the start (0 until then)."""
        return self._loop.time() - self._start_s if self.started else 0.0

    @property
    def remaining_s(self) -> float:
        """Until the ceiling."""
        return max(0.0, self._ceiling_at - self._loop.time())

    @property
    def expected_seq(self) -> int:
        """The sequence number the peer's next message must carry."""
        return self._recv_seq

    def start(self) -> None:
        """Mark the prefill's start (`elapsed_s` counts from it); a no-op once started."""
        if not self.started and not self.finished:
            self.started = True
            self._start_s = self._loop.time()

    def touch(self) -> None:
        """Progress: the no-progress timer starts over."""
        self._last_progress_s = self._loop.time()

    def set_ceiling(self, ceiling_s: float) -> None:
        """The session ends at most `ceiling_s` from now (no-op once finished)."""
        if self.finished:
            return
        self.ceiling_s = ceiling_s
        self._ceiling_at = self._loop.time() + ceiling_s
        self._ceiling_timer.cancel()
        self._ceiling_timer = self._loop.call_later(ceiling_s, self._on_ceiling)

    def add_finish_callback(self, callback: Callable[[TransferSession], None]) -> None:
        """Call `callback(self)` once, when the session reaches SUCCESS or FAILED."""
        self._finish_callbacks.append(callback)

    async def wait(self, timeout_s: float | None = None) -> TransferState:
        """The final state; FAILED when it is not reached within `timeout_s` (default: the
        session's own deadlines, which always end it)."""
        if timeout_s is None:
            await self._done.wait()
            return self.state
        try:
            await asyncio.wait_for(self._done.wait(), timeout_s)
        except TimeoutError:
            self.fail(f"no result within {timeout_s:.3g}s of waiting")
        return self.state

    def abort(self, reason: str) -> None:
        """End the session as FAILED and tell the peer (no-op once finished): a failure, logged
        as one (WARNING)."""
        self.fail(f"aborted: {reason}")

    def cancel(self, reason: str) -> None:
        """End the session as FAILED and tell the peer because nobody needs it any more (the
        request finished or was cancelled): logged at DEBUG."""
        self.fail(f"cancelled: {reason}", level=logging.DEBUG)

    def fail(self, reason: str, *, notify_peer: bool = True, level: int = logging.WARNING) -> None:
        """Mark FAILED (logged at `level`) and, unless the peer ended it, send it a failed
        result."""
        if self.finished:
            return
        self.state = TransferState.FAILED
        self.error = reason
        self.log(level, "%s %s failed: %s", self.role, self.transfer_id, reason)
        if notify_peer and self._peer_address is not None:
            result = transfer_pb2.TransferResult(ok=False, error=reason)
            self.spawn(self._notify(result=result))
        self._finish()

    def log(self, level: int, msg: str, *args: object) -> None:
        """A log line about this session, tagged with its request's id."""
        logger.log(level, msg, *args, extra={"request_id": self.log_id} if self.log_id else None)

    async def settle(self, timeout_s: float) -> None:
        """Give background sends (results, failure notices) `timeout_s` to finish; cancel the
        rest."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout_s)
        for task in list(self._tasks):
            task.cancel()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run `coro` in the background, owned by this session."""
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _advance(self, state: TransferState) -> None:
        if not self.finished and state > self.state:
            self.state = state

    def _succeed(self) -> None:
        if not self.finished:
            self.state = TransferState.SUCCESS
            self._finish()

    def _finish(self) -> None:
        self._idle_timer.cancel()
        self._ceiling_timer.cancel()
        self._done.set()
        for callback in self._finish_callbacks:
            callback(self)

    def _on_idle_timer(self) -> None:
        """Re-armed for what is left while progress came since (no timer churn per message)."""
        left_s = self._last_progress_s + self.timeout_s - self._loop.time()
        if left_s > 0:
            self._idle_timer = self._loop.call_later(left_s, self._on_idle_timer)
            return
        self.fail(f"timed out: no progress for {self.timeout_s:.3g}s (in state {self.state.name})")

    def _on_ceiling(self) -> None:
        self.fail(
            f"timed out: not done within its ceiling of {self.ceiling_s:.3g}s (in state "
            f"{self.state.name})"
        )

    def _check_envelope(self, msg: TransferMessage) -> str | None:
        """Why an incoming message is out of sequence, or None (and count it)."""
        if msg.seq != self._recv_seq:
            return f"message seq {msg.seq} out of order: expected {self._recv_seq}"
        self._recv_seq += 1
        return None

    async def _send(self, payload: torch.Tensor | None = None, **kind: MessageBody) -> bool:
        """Send one message to the peer within the deadline; on failure fail the session."""
        return await self._send_all([(payload, kind)])

    async def _send_all(
        self,
        messages: Sequence[Outgoing],
        submitted: asyncio.Future[None] | None = None,
    ) -> bool:
        """Send (payload, kind) messages to the peer as one transport message (`send_many`)
        within the deadline; on failure fail the session. `submitted` is resolved once they
        are numbered: a message sent after its waiters wake goes behind them (the transport
        numbers a send before the send first suspends, and waiters wake only after that)."""
        assert self._peer_address is not None
        parts = await self._payload_parts(messages)
        if parts is None:
            return False
        encoded = []
        for (payload, kind), part in zip(messages, parts, strict=True):
            body = protocol.encode(self.transfer_id, self._send_seq, **kind)
            encoded.append((self.frames.seal(self._send_seq, body, part), payload))
            self._send_seq += 1
        if submitted is not None and not submitted.done():
            submitted.set_result(None)
        self._on_sending()
        if len(encoded) == 1:
            sending = self._transport.send(self._peer_address, *encoded[0])
        else:
            sending = self._transport.send_many(self._peer_address, encoded)
        try:
            # Not wait_for: on 3.11 it runs `sending` as a task of its own, a loop iteration
            # later, so a caller that goes on packing the next layer holds this one back.
            # one send that takes longer than the no-progress timeout is no progress either
            bound_s = min(self.remaining_s, self.timeout_s)
            if bound_s <= 0:
                sending.close()
                raise TimeoutError
            async with asyncio.timeout(bound_s):
                await sending
        except TimeoutError:
            self.fail(f"send to {self._peer_address} timed out", notify_peer=False)
            return False
        except TransportError as e:
            self.fail(f"send to {self._peer_address} failed: {e}", notify_peer=False)
            return False
        return True

    def _on_sending(self) -> None:
        """Messages are going out (numbered): what a role counts as its progress."""

    async def _payload_parts(self, messages: Sequence[Outgoing]) -> list[Any] | None:
        """What each message's MAC covers of its payload (awaited only for CUDA payloads with
        a frame key: their digests); None when the session ended meanwhile."""
        if self.frames.key is None:
            return [[] for _ in messages]
        try:
            async with asyncio.timeout(max(self.remaining_s, 1e-3)):
                parts = await self.frames.parts(messages)
        except TimeoutError:
            self.fail("the payloads' digests were not computed before the deadline")
            return None
        return None if self.finished else parts

    async def _notify(self, **kind: MessageBody) -> None:
        """Best-effort message once the session is finished (its deadline no longer applies)."""
        assert self._peer_address is not None
        body = protocol.encode(self.transfer_id, self._send_seq, **kind)
        header = self.frames.seal(self._send_seq, body, [])
        self._send_seq += 1
        await self._send_best_effort(self._peer_address, header)

    async def _send_best_effort(self, address: str, header: bytes) -> None:
        """One header-only message, bounded by NOTIFY_TIMEOUT_S; a failure is only logged."""
        try:
            await asyncio.wait_for(self._transport.send(address, header), NOTIFY_TIMEOUT_S)
        except (TimeoutError, TransportError) as e:
            self.log(logging.INFO, "%s %s: could not tell the peer (%s)", self.role,
                     self.transfer_id, e)  # fmt: skip
