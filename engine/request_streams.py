"""`RequestStreams`: `AsyncEngine`'s per-request output queues and the aborts that end them.

    open(request, add)          the request's stream, its add queued on the engine thread
    drain(request, stream)      its outputs, until one finishes it (or marks its prefill done);
                                a consumer that stops reading aborts it (this very request)
    end(request_id) -> bool     put a final abort output on its stream now (True: it had one)
    queue_abort(id, abort)      the engine-side abort, queued; until it ran the engine's outputs
                                for the id are stale and dropped (even a new stream's of the id)
    deliver(outputs)            the engine thread's outputs, each to its stream (on the loop)
    fail(error)                 the engine thread ended: every stream raises `error`

Every method runs on the event loop; the engine thread reaches it through `EngineThread`'s
callbacks (`deliver`, `fail`), which it calls there.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from engine.engine_core import EngineCore
from engine.engine_thread import EngineDeadError, EngineThread
from engine.outputs import StepOutput
from engine.request import FinishReason, Request

logger = logging.getLogger(__name__)

T = TypeVar("T")
Stream = asyncio.Queue[StepOutput | BaseException]


class RequestStreams:
    def __init__(self, core: EngineCore, thread: EngineThread) -> None:
        self._core = core
        self._thread = thread
        self._streams: dict[str, Stream] = {}
        # Request ids whose engine-side abort is queued: their outputs until it ran are stale.
        self._ending: collections.Counter[str] = collections.Counter()

    def get(self, request_id: str) -> Stream | None:
        return self._streams.get(request_id)

    def open(self, request: Request, add: Callable[[], None]) -> Stream:
        """The request's stream, with its add queued: an error from the add ends the stream."""
        request_id = request.request_id
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already streaming")
        stream: Stream = asyncio.Queue()

        def added(result: Any, error: BaseException | None) -> None:
            if error is not None:
                stream.put_nowait(error)

        self._thread.submit(add, added)
        self._streams[request_id] = stream
        return stream

    def end(self, request_id: str) -> bool:
        stream = self._streams.get(request_id)
        if stream is None:
            return False
        stream.put_nowait(StepOutput(request_id, [], finish_reason=FinishReason.ABORT))
        return True

    async def drain(self, request: Request, stream: Stream) -> AsyncIterator[StepOutput]:
        done = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    done = True
                    raise item
                done = item.finished or item.prefill_done
                yield item
                if done:
                    return
        finally:
            if self._streams.get(request.request_id) is stream:
                del self._streams[request.request_id]
            if not done:  # the consumer went away (cancelled, or stopped reading): free it
                self.abort_unawaited(
                    request.request_id, lambda: _abort_if_added(self._core, request)
                )

    def queue_abort(self, request_id: str, abort: Callable[[], bool]) -> asyncio.Future[bool]:
        """Queue the engine-side abort. Until it has run, the engine's outputs for the id are
        stale (those of the aborted request, published before it): dropped, even if a new
        request of the same id opens a stream meanwhile (its add runs after the abort)."""
        known: asyncio.Future[bool] = self._thread.loop().create_future()

        def done(result: Any, error: BaseException | None) -> None:
            self._ending[request_id] -= 1
            if self._ending[request_id] <= 0:
                del self._ending[request_id]
            settle(known, result, error)

        self._thread.submit(abort, done)
        self._ending[request_id] += 1
        return known

    def abort_unawaited(self, request_id: str, abort: Callable[[], bool]) -> None:
        with contextlib.suppress(EngineDeadError):  # (dead: the engine holds nothing any more)
            self.queue_abort(request_id, abort).add_done_callback(log_failure)

    def deliver(self, outputs: list[StepOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None and out.request_id not in self._ending:
                stream.put_nowait(out)

    def fail(self, error: EngineDeadError) -> None:
        for stream in self._streams.values():
            stream.put_nowait(error)


def _abort_if_added(core: EngineCore, request: Request) -> bool:
    """Abort `request` if this very request is the one the engine holds under its id (not
    another call's that reuses the id)."""
    if core.get_request(request.request_id) is request:
        return core.abort(request.request_id)
    return False


def settle(future: asyncio.Future[T], result: T, error: BaseException | None) -> None:
    """A command's outcome into its future (nothing if its waiter was cancelled)."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def log_error(result: object, error: BaseException | None) -> None:
    """Done-callback of a command nobody awaits (an engine gone holds nothing: not logged)."""
    if error is not None and not isinstance(error, EngineDeadError):
        logger.error("an engine command failed: %r", error, exc_info=error)


def log_failure(future: asyncio.Future[Any]) -> None:
    """Done-callback of a future nobody awaits: its error is logged, not lost."""
    if not future.cancelled() and future.exception() is not None:
        log_error(None, future.exception())
