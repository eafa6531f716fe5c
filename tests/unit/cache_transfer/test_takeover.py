"""A retried sender takes over a receiver that still waits (the router's prefill retry), and
nobody takes over a session that is done."""

from __future__ import annotations

import pytest
from forger import (
    DST_BLOCK_IDS,
    LAYOUT,
    MARKER,
    Forger,
    caches,
    forged_session,
    full_transfer,
    no_marker,
)
from transfer_helpers import make_raw_peer, messages_handled, run, wait_until

from cache_transfer import TransferState, protocol

pytestmark = pytest.mark.timeout(60)


def test_a_retried_sender_takes_over_a_waiting_session(backend: str) -> None:
    """The router's prefill retry: a second sender's handshake (same ticket) takes over from
    one that sent a layer and went silent; its KV lands, the first one's late layer is dropped."""

    async def scenario() -> tuple[TransferState, str | None, bool, list]:
        manager, receiver, first = await forged_session(backend)
        retry = Forger(await make_raw_peer(backend), receiver)
        try:
            await first.handshake()
            await first.layer(0, value=1.0)
            await wait_until(lambda: receiver.state == TransferState.TRANSFERRING)
            await retry.handshake()
            await wait_until(lambda: len(retry.peer.received) == 1, 10.0)  # taken over: acked
            await first.layer(1, value=MARKER)  # the first sender, late: dropped
            for layer_idx in range(LAYOUT.num_layers):
                await retry.layer(layer_idx, value=2.0)
            await retry.first_token()
            state = await receiver.wait(timeout_s=5)
            done = [(k[DST_BLOCK_IDS[:3]], v[DST_BLOCK_IDS[:3]]) for k, v in caches(manager)]
            landed = all(bool((k == 2.0).all() and (v == 2.0).all()) for k, v in done)
            await wait_until(lambda: len(retry.peer.received) >= 2, 10.0)  # ack, result
            return state, receiver.error, landed, [h for _, h in retry.peer.received]
        finally:
            await manager.close()
            for forger in (first, retry):
                await forger.peer.transport.close()

    state, error, landed, headers = run(scenario())
    assert state == TransferState.SUCCESS, error
    assert landed, "every block holds the retried sender's KV"
    replies = [protocol.decode(header) for header in headers]
    assert [m.seq for m in replies] == [0, 1] and replies[1].result.ok


def test_no_takeover_once_the_first_token_came(backend: str) -> None:
    """A session that succeeded: a late handshake and layer from anyone change nothing."""

    async def scenario() -> tuple[TransferState, bool]:
        manager, receiver, first = await forged_session(backend)
        late = Forger(await make_raw_peer(backend), receiver)
        try:
            await full_transfer(first)
            assert await receiver.wait(timeout_s=5) == TransferState.SUCCESS
            handled = messages_handled(manager)
            await late.handshake()
            await late.layer(0, value=MARKER)
            await wait_until(lambda: handled == ["complete", "refused"], 10.0)  # handshake, layer
            return receiver.state, no_marker(manager)
        finally:
            await manager.close()
            for forger in (first, late):
                await forger.peer.transport.close()

    assert run(scenario()) == (TransferState.SUCCESS, True)
