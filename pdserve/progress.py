"""Progress of long work (converting a GGUF file, loading a model's weights).

```
Progress / track       work counted in units
  stderr a terminal    a tqdm bar on stderr (gone when the work is done)
  otherwise            a log line "<what>: 40% (12/30 tensors, 3.1 s)" each time another
                       LOG_EVERY_FRACTION of the work is done or LOG_EVERY_S passed since the
                       last line, whichever comes first (node processes under pd-serve, pods)
still_working          one step that cannot be counted (a library call): its time so far, on
                       the bar or in a log line every LOG_EVERY_S, from a thread, until it ends
```
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import IO, TypeVar

from tqdm import tqdm

T = TypeVar("T")

LOG_EVERY_FRACTION = 0.1
LOG_EVERY_S = 5.0


class Progress:
    """Counts `total` units of work as `update` reports them."""

    def __init__(
        self,
        what: str,
        total: int,
        unit: str,
        logger: logging.Logger,
        stream: IO[str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        stream = sys.stderr if stream is None else stream
        self.what = what
        self.total = max(total, 0)
        self.unit = unit
        self.done = 0
        self._logger = logger
        self._clock = clock
        self._start_s = self._last_log_s = clock()
        self._next_fraction = LOG_EVERY_FRACTION
        self._bar = None
        if _is_terminal(stream):
            self._bar = tqdm(total=self.total, desc=what, unit=f" {unit}", file=stream,
                             leave=False, dynamic_ncols=True)  # fmt: skip

    def update(self, num: int = 1) -> None:
        self.done += num
        if self._bar is not None:
            self._bar.update(num)
            return
        now = self._clock()
        fraction = self.done / self.total if self.total else 1.0
        if fraction + 1e-9 >= self._next_fraction or now - self._last_log_s >= LOG_EVERY_S:
            self._log(fraction, now)

    def _log(self, fraction: float, now: float) -> None:
        self._logger.info(
            "%s: %d%% (%d/%d %s, %.1f s)", self.what, int(100 * fraction), self.done, self.total,
            self.unit, now - self._start_s,
        )  # fmt: skip
        self._last_log_s = now
        # the next step past what is done now (several steps may pass in one update)
        steps = math.floor(fraction / LOG_EVERY_FRACTION + 1e-9) + 1
        self._next_fraction = steps * LOG_EVERY_FRACTION

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def track(
    items: Iterable[T],
    what: str,
    total: int,
    unit: str,
    logger: logging.Logger,
    stream: IO[str] | None = None,
) -> Iterator[T]:
    """`items`, each counted once the consumer asks for the next one (it is then done)."""
    with Progress(what, total, unit, logger, stream) as progress:
        for item in items:
            yield item
            progress.update()


@contextlib.contextmanager
def still_working(
    what: str,
    logger: logging.Logger,
    stream: IO[str] | None = None,
    interval_s: float = LOG_EVERY_S,
) -> Iterator[None]:
    """Says, every `interval_s` while the block runs, that `what` is still going and since
    when (a bar that counts seconds on a terminal)."""
    stream = sys.stderr if stream is None else stream
    done = threading.Event()
    start_s = time.monotonic()
    bar = None
    if _is_terminal(stream):
        bar = tqdm(desc=what, bar_format="{desc}: {elapsed}", file=stream, leave=False)

    def report() -> None:
        while not done.wait(interval_s):
            if bar is not None:
                bar.refresh()
            else:
                logger.info("%s: still going (%.0f s)", what, time.monotonic() - start_s)

    thread = threading.Thread(target=report, name="still-working", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        if bar is not None:
            bar.close()


def _is_terminal(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or closed
        return False
