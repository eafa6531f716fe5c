"""`SendOrder`: the first token goes right behind a `KVSender`'s layer messages; the sender
owns one.

    submitted = begin()        a layer message on its way (resolved once the transport
                               numbered it: the sender's `_send_all` sets it)
    end(submitted)             its send is over, sent or not (resolved if it was not)
    await behind_layers(t)     every layer message begun so far is numbered (or `t` passed)

The transport delivers in the order it numbers, so the first token need not wait for the
layers' sends to complete, only for them to be numbered.
"""

from __future__ import annotations

import asyncio


class SendOrder:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._unsubmitted: set[asyncio.Future[None]] = set()  # not numbered yet

    def begin(self) -> asyncio.Future[None]:
        submitted: asyncio.Future[None] = self._loop.create_future()
        self._unsubmitted.add(submitted)
        return submitted

    def end(self, submitted: asyncio.Future[None]) -> None:
        self._unsubmitted.discard(submitted)
        if not submitted.done():  # nothing was sent (finished, refused, a failed write)
            submitted.set_result(None)

    async def behind_layers(self, timeout_s: float) -> None:
        if self._unsubmitted:
            await asyncio.wait(set(self._unsubmitted), timeout=timeout_s)
