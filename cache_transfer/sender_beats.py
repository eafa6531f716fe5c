"""`SenderBeats`: when a `KVSender` tells its receiver that its node progresses.

A receiver fails a hand-off after `timeout_s` without a message. A prefill node whose engine
progresses (this prompt's chunks, or the prompts queued ahead of it) says so with a `Progress`
message, but only when nothing else went out for `interval_s` (a quarter of `timeout_s`, at
most `MAX_BEAT_INTERVAL_S`), and one at a time: a busy sender sends no beats at all.
"""

from __future__ import annotations

import asyncio

MAX_BEAT_INTERVAL_S = 5.0  # a sender whose node progresses says so at least this often


class SenderBeats:
    def __init__(self, loop: asyncio.AbstractEventLoop, timeout_s: float) -> None:
        self._loop = loop
        self.interval_s = min(timeout_s / 4, MAX_BEAT_INTERVAL_S)
        self._last_sent_s = loop.time()

    def sent(self) -> None:
        """A message went out now."""
        self._last_sent_s = self._loop.time()

    def due(self) -> bool:
        """Whether a beat should go now (nothing went out for `interval_s`); True counts it as
        sent (one beat in flight at a time)."""
        if self._loop.time() - self._last_sent_s < self.interval_s:
            return False
        self.sent()
        return True
