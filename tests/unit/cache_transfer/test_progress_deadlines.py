"""Issue 34: a hand-off's deadline measures lack of progress. A sender whose node keeps
progressing (`beat`) keeps its receiver waiting past the no-progress timeout and hands off; a
silent one fails it within that timeout; a sender that says it progresses forever still ends
at the ceiling (its own, told in the handshake, capped by the receiver's); progress that goes
backwards is refused; a cancel is logged at DEBUG, tagged with the request's id."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from transfer_helpers import make_layout, make_pair, run, wait_until

from cache_transfer import TransferState
from pdserve.security import ClusterAuth
from pdserve.v1 import transfer_pb2

pytestmark = pytest.mark.timeout(60)

TIMEOUT_S = 0.5  # no progress for this long fails a session


async def _beat_until(sender, stop: asyncio.Event, interval_s: float = 0.05) -> None:
    """The sender's node progressing (queued: 0 computed tokens), as ProgressBeats would."""
    while not stop.is_set() and not sender.finished:
        sender.beat(0)
        await asyncio.sleep(interval_s)


@pytest.mark.parametrize("secret", [False, True])
def test_progress_keeps_a_hand_off_alive_past_the_timeout(secret: bool) -> None:
    """With a cluster secret the Progress messages carry their MACs like every other."""

    async def scenario() -> None:
        auth = ClusterAuth(b"cluster-secret-0123456789abcdef") if secret else None
        pair = await make_pair("local", make_layout(), auth=auth)
        receiver = pair.decode.create_receiver(
            [1, 2, 3], num_tokens=12, timeout_s=TIMEOUT_S, max_ceiling_s=30.0
        )
        sender = pair.prefill.create_sender(receiver.ticket(), TIMEOUT_S, ceiling_s=30.0)
        stop = asyncio.Event()
        beats = asyncio.create_task(_beat_until(sender, stop))
        await asyncio.sleep(6 * TIMEOUT_S)  # queued: only beats move
        assert receiver.state == sender.state == TransferState.WAITING
        assert not receiver.started  # the queue is not the hand-off's own time
        stop.set()
        await beats
        sender.start()
        await sender.send_layers(
            [(i, *pair.src_caches[i]) for i in range(pair.layout.num_layers)], [0, 1, 2]
        )
        await sender.send_first_token(5)
        assert await receiver.wait() == TransferState.SUCCESS
        assert await sender.wait() == TransferState.SUCCESS
        assert receiver.elapsed_s < 6 * TIMEOUT_S

    run(scenario())


def test_a_silent_sender_fails_within_the_no_progress_timeout() -> None:
    async def scenario() -> None:
        pair = await make_pair("local", make_layout())
        receiver = pair.decode.create_receiver(
            [1, 2, 3], num_tokens=12, timeout_s=TIMEOUT_S, max_ceiling_s=30.0
        )
        sender = pair.prefill.create_sender(receiver.ticket(), timeout_s=30.0, ceiling_s=30.0)
        await wait_until(lambda: receiver.state == TransferState.WAITING)
        start_s = time.monotonic()
        assert await receiver.wait() == TransferState.FAILED
        assert time.monotonic() - start_s < 10 * TIMEOUT_S
        assert "no progress for 0.5s" in (receiver.error or "")
        await wait_until(lambda: sender.finished)  # told: it stops too
        assert sender.state == TransferState.FAILED

    run(scenario())


@pytest.mark.parametrize("whose", ["sender", "receiver"])
def test_progress_forever_still_ends_at_the_ceiling(whose: str) -> None:
    """The sender's ceiling (told in its handshake), or the receiver's cap when smaller."""
    sender_ceiling_s, receiver_cap_s = (1.0, 30.0) if whose == "sender" else (30.0, 1.0)

    async def scenario() -> None:
        pair = await make_pair("local", make_layout())
        receiver = pair.decode.create_receiver(
            [1, 2, 3], num_tokens=12, timeout_s=TIMEOUT_S, max_ceiling_s=receiver_cap_s
        )
        sender = pair.prefill.create_sender(receiver.ticket(), TIMEOUT_S, sender_ceiling_s)
        stop = asyncio.Event()
        beats = asyncio.create_task(_beat_until(sender, stop))
        start_s = time.monotonic()
        assert await receiver.wait() == TransferState.FAILED
        took_s = time.monotonic() - start_s
        stop.set()
        await beats
        assert "ceiling of 1s" in (receiver.error or "") or "ceiling of 1s" in (
            sender.error or ""
        ), (receiver.error, sender.error)
        assert 2 * TIMEOUT_S < took_s < 10.0  # past the no-progress timeout: the beats held

    run(scenario())


def test_progress_that_goes_backwards_is_refused() -> None:
    async def scenario() -> None:
        pair = await make_pair("local", make_layout())
        receiver = pair.decode.create_receiver([1, 2, 3], num_tokens=12, timeout_s=5.0)
        sender = pair.prefill.create_sender(receiver.ticket(), timeout_s=5.0)
        await wait_until(lambda: sender.state == TransferState.WAITING)
        await sender._send(progress=transfer_pb2.Progress(num_computed_tokens=8))
        await wait_until(lambda: receiver.num_computed_tokens == 8)
        assert receiver.started  # computed tokens: the prefill started
        await sender._send(progress=transfer_pb2.Progress(num_computed_tokens=4))
        assert await receiver.wait() == TransferState.FAILED
        assert "progress of 4 computed tokens after 8" in (receiver.error or "")

    run(scenario())


def test_a_cancel_is_logged_at_debug_with_the_request_id(caplog) -> None:
    async def scenario() -> None:
        pair = await make_pair("local", make_layout())
        receiver = pair.decode.create_receiver(
            [1, 2, 3], num_tokens=12, timeout_s=5.0, log_id="req-7"
        )
        sender = pair.prefill.create_sender(receiver.ticket(), timeout_s=5.0, log_id="req-7")
        await wait_until(lambda: sender.state == TransferState.WAITING)
        receiver.cancel("the request finished")
        await wait_until(lambda: sender.finished)

    caplog.set_level(logging.DEBUG, logger="cache_transfer")
    run(scenario())
    ended = [r for r in caplog.records if "failed:" in r.getMessage()]
    assert ended and all(r.levelno < logging.WARNING for r in ended), ended
    assert all(getattr(r, "request_id", "") == "req-7" for r in ended)
