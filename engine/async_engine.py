"""`AsyncEngine`: runs an `EngineCore` on its own thread for asyncio servers.

    asyncio callers ──command──> SimpleQueue ──> engine thread: apply commands, step()
    engine thread ──StepOutput──> loop.call_soon_threadsafe ──> per-request asyncio.Queue

The engine thread is the only one that touches the EngineCore. Every command returns an
awaitable answered from that thread; a request's outputs arrive on its own stream, which
ends after the output that finishes it (or marks its prefill done, in prefill-only mode).
Cancelling the consumer of a stream aborts the request in the engine.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from engine.block_hash import request_block_hashes
from engine.engine_core import EngineCore, EngineStats
from engine.outputs import StepOutput
from engine.request import FinishReason, Request

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.05


class EngineDeadError(RuntimeError):
    """The engine thread stopped (a step raised); the request cannot complete."""


class AsyncEngine:
    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], asyncio.Future | None]] = (
            queue.SimpleQueue()
        )
        self._streams: dict[str, asyncio.Queue[StepOutput | BaseException]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._error: BaseException | None = None
        # The engine's stats after its last step or command, written by the engine thread:
        # readers that must not wait for a step (a registry heartbeat) use it.
        self.last_stats: EngineStats = core.stats()
        # How the prefix cache hashes blocks (fixed at start), for hash_prompt_ahead.
        kv = core.kv_cache_manager
        self._block_hashing = (kv.block_size, kv.root_hash) if kv.enable_prefix_caching else None

    # ---- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    async def stop(self, timeout_s: float = 10.0) -> None:
        self._stopping.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout_s)

    # ---- commands -------------------------------------------------------------------------

    async def call(self, fn: Callable[[EngineCore], Any], timeout_s: float = 30.0) -> Any:
        """Run `fn(core)` on the engine thread and return its result (or raise its error)."""
        self._check_alive()
        future = self._loop.create_future()
        self._commands.put((lambda: fn(self.core), future))
        # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow the caller's cancellation.
        async with asyncio.timeout(timeout_s):
            return await future

    def post(self, fn: Callable[[EngineCore], Any]) -> None:
        """Run `fn(core)` on the engine thread without waiting for it: cleanup from a task that
        may be cancelled (an error is logged, not raised)."""

        def run_logged() -> None:
            try:
                fn(self.core)
            except Exception:
                logger.exception("a posted engine command failed")

        self._commands.put((run_logged, None))

    async def generate(self, request: Request) -> AsyncIterator[StepOutput]:
        """Add a request for local prefill and stream its outputs."""
        stream = self._open_stream(request.request_id)
        await self._add(request, lambda core: core.add_request(request))
        async for out in self._drain(request.request_id, stream):
            yield out

    def hash_prompt_ahead(self, request: Request) -> None:
        """Hash the full blocks of a request's prompt on the caller's thread, before the engine
        holds it (a decode node, while the prompt's KV is on its way): admitting it then finds
        the prefix cache's digests computed instead of hashing them on the engine thread
        (an 8K-token prompt: ~1 ms on the 2-core CPU VM, `pdserve.block_hash.block_hashes`
        timed alone; every running request's next step waited that long). Nothing when prefix
        caching is off."""
        if self._block_hashing is not None:
            block_size, root = self._block_hashing
            request_block_hashes(request, request.prompt_len // block_size, block_size, root)

    async def resume(
        self, request: Request, block_ids: Sequence[int], first_token: int
    ) -> AsyncIterator[StepOutput]:
        """Admit a request whose prompt KV is in its reserved blocks; stream its outputs."""
        stream = self._open_stream(request.request_id)
        await self._add(request, lambda core: core.add_prefilled(request, block_ids, first_token))
        async for out in self._drain(request.request_id, stream):
            yield out

    async def abort(self, request_id: str) -> bool:
        """Abort wherever the request is; its stream (if any) ends with finish_reason abort."""
        known = await self.call(lambda core: core.abort(request_id))
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.put_nowait(StepOutput(request_id, [], finish_reason=FinishReason.ABORT))
        return known

    # ---- internals ------------------------------------------------------------------------

    async def _add(self, request: Request, add: Callable[[EngineCore], Any]) -> None:
        """Run the command that adds `request`. If the caller is cancelled (or times out)
        while the command is queued or running, the command still runs on the engine thread:
        an abort queued behind it (commands run in order) frees whatever it added, so a
        cancelled call never leaves the request in the engine (prefilling, or held PREFILLED
        with its blocks). An error from the command itself means nothing was added."""
        try:
            await self.call(add)
        except BaseException as error:
            self._streams.pop(request.request_id, None)
            if isinstance(error, (asyncio.CancelledError, TimeoutError)):
                self.post(lambda core: _abort_if_added(core, request))
            raise

    def _open_stream(self, request_id: str) -> asyncio.Queue:
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already streaming")
        stream: asyncio.Queue[StepOutput | BaseException] = asyncio.Queue()
        self._streams[request_id] = stream
        return stream

    async def _drain(self, request_id: str, stream: asyncio.Queue) -> AsyncIterator[StepOutput]:
        done = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    done = True
                    raise item
                if item.finished or item.prefill_done:
                    done = True
                yield item
                if done:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not done and self._error is None:
                # The consumer went away (cancelled, or stopped iterating): free the request.
                self._commands.put((lambda: self.core.abort(request_id), None))

    def _check_alive(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"the engine stopped: {self._error!r}")
        if self._thread is None:
            raise RuntimeError("AsyncEngine.start() was not called")

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                self._apply_commands(block=not self.core.has_unfinished())
                if self.core.has_unfinished():
                    self._publish(self.core.step())
                self.last_stats = self.core.stats()
        except BaseException as exc:  # noqa: BLE001 - reported to every waiter
            logger.exception("engine thread failed")
            self._error = exc
            self._loop.call_soon_threadsafe(self._fail_all, exc)

    def _apply_commands(self, block: bool) -> None:
        try:
            command = (
                self._commands.get(timeout=_IDLE_WAIT_S) if block else self._commands.get_nowait()
            )
        except queue.Empty:
            return
        while True:
            fn, future = command
            try:
                result, error = fn(), None
            except Exception as exc:  # noqa: BLE001 - handed back to the caller
                result, error = None, exc
            if future is not None:
                self._loop.call_soon_threadsafe(_settle, future, result, error)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _publish(self, outputs: list[StepOutput]) -> None:
        if outputs:
            self._loop.call_soon_threadsafe(self._deliver, outputs)

    def _deliver(self, outputs: list[StepOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put_nowait(out)

    def _fail_all(self, exc: BaseException) -> None:
        error = EngineDeadError(f"the engine stopped: {exc!r}")
        for stream in self._streams.values():
            stream.put_nowait(error)


def _abort_if_added(core: EngineCore, request: Request) -> None:
    """Abort `request` if this very request is the one the engine holds under its id (not
    another call's that reuses the id)."""
    if core.get_request(request.request_id) is request:
        core.abort(request.request_id)


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
