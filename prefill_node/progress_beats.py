"""`ProgressBeats`: the prefill engine's progress, told to the decode nodes awaiting its KV.

    engine thread  on_layer_done(layer_idx, chunks)   the engine's per-layer hook (beside the
                                                      LayerStreamer's): at most every
                                                      CHECK_INTERVAL_S, call_soon_threadsafe
    event loop     beat(): for every live sender, sender.beat(its prompt's computed tokens)
                   (a tensor-parallel rank's FanOutSender: each of its routes)
                   (KVSender sends a Progress message only when it sent nothing else for its
                   beat interval: a busy hand-off costs no extra message)

A decode node waits for a hand-off as long as it hears progress (cache_transfer/README.md,
"Deadlines"). Any prefill step is progress for every request queued here: the engine computes
prompts in arrival order, so one queued behind others gets its turn while the engine works.
An engine that stops stepping sends nothing, and its receivers time out.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Sequence

from engine.outputs import PrefillLayerChunk
from prefill_node.outgoing import KVSink

CHECK_INTERVAL_S = 0.1  # the engine thread posts a beat at most this often


class ProgressBeats:
    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        senders: Callable[[], Iterable[tuple[KVSink, int]]],
        check_interval_s: float = CHECK_INTERVAL_S,
    ) -> None:
        """`senders()`: (event loop) each live sender and how many of its prompt's tokens are
        computed (`LayerStreamer.progress`)."""
        self._loop = loop
        self._senders = senders
        self._check_interval_s = check_interval_s
        self._last_check_s = 0.0

    def on_layer_done(self, layer_idx: int, chunks: Sequence[PrefillLayerChunk]) -> None:
        """(engine thread) The engine computed a layer of a step: progress."""
        now = time.monotonic()
        if now - self._last_check_s >= self._check_interval_s:
            self._last_check_s = now
            self._loop.call_soon_threadsafe(self.beat)

    def beat(self) -> None:
        """(event loop) Every live sender may tell its receiver."""
        for sender, num_computed_tokens in self._senders():
            sender.beat(num_computed_tokens)
