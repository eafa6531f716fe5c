"""`EngineThread`: the one thread that touches an `EngineCore`, and its queue of commands.

    submit(fn, done) ──> SimpleQueue ──> engine thread: the queued fns in order, then step()
                                          while the core has work
    engine thread ──loop.call_soon_threadsafe──> done(result, error)     each command, in order
                                             ──> on_outputs(outputs)     each step's outputs,
                                                 before the done of any command run after it
    the thread ends (stop, or a step raised) ──> every queued command and every later submit:
        done(None, EngineDeadError); on_dead(error) on the loop

A command has no timeout: it runs when the thread gets to it, after the step in progress, and
its `done` runs then, whether or not anybody still waits for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from engine.engine_core import EngineCore, EngineStats
from engine.outputs import StepOutput

logger = logging.getLogger(__name__)

# Runs on the event loop with a command's (result, error) once the engine thread ran it.
Done = Callable[[Any, BaseException | None], None]

_IDLE_WAIT_S = 0.05  # the idle engine thread looks for commands this often (and for stop)


class EngineDeadError(RuntimeError):
    """The engine thread stopped (stopped, or a step raised); the request cannot complete."""


class EngineThread:
    def __init__(
        self,
        core: EngineCore,
        on_outputs: Callable[[list[StepOutput]], None],
        on_dead: Callable[[EngineDeadError], None],
    ) -> None:
        self._core = core
        self._on_outputs = on_outputs
        self._on_dead = on_dead
        self._commands: queue.SimpleQueue[tuple[Callable[[], object], Done | None]] = (
            queue.SimpleQueue()
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._closed = False  # the thread ended: it runs no more commands
        self._error: BaseException | None = None
        # The core's stats after its last step or command (written by the engine thread).
        self.last_stats: EngineStats = core.stats()

    @property
    def num_queued(self) -> int:
        """Commands waiting for the thread (tests watch this to order a race)."""
        return self._commands.qsize()

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    async def stop(self, timeout_s: float) -> None:
        self._stopping.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout_s)

    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop results go to. RuntimeError before `start`."""
        if self._loop is None:
            raise RuntimeError("AsyncEngine.start() was not called")
        return self._loop

    def submit(self, fn: Callable[[], object], done: Done | None) -> None:
        """Queue `fn` for the engine thread; `done(result, error)` runs on the loop once it
        ran. EngineDeadError (raised here) when the thread has ended."""
        self.loop()
        if self._error is not None:
            raise EngineDeadError(f"the engine stopped: {self._error!r}")
        if self._closed:
            raise EngineDeadError("the engine stopped")
        self._commands.put((fn, done))
        if self._closed:  # the thread ended meanwhile: answer what it left behind
            self._fail_commands(EngineDeadError("the engine stopped"))

    def _run(self) -> None:
        error = EngineDeadError("the engine stopped")
        try:
            while not self._stopping.is_set():
                self._apply_commands(block=not self._core.has_unfinished())
                if self._core.has_unfinished():
                    outputs = self._core.step()
                    if outputs:
                        self._call_soon(self._on_outputs, outputs)
                self.last_stats = self._core.stats()
        except BaseException as exc:  # noqa: BLE001 - reported to every waiter
            logger.exception("engine thread failed")
            self._error = exc
            error = EngineDeadError(f"the engine stopped: {exc!r}")
        finally:
            self._closed = True
            self._fail_commands(error)
            self._call_soon(self._on_dead, error)

    def _apply_commands(self, block: bool) -> None:
        try:
            command = (
                self._commands.get(timeout=_IDLE_WAIT_S) if block else self._commands.get_nowait()
            )
        except queue.Empty:
            return
        while True:
            fn, done = command
            try:
                result, error = fn(), None
            except Exception as exc:  # noqa: BLE001 - handed back to the caller
                result, error = None, exc
            if done is not None:
                self._call_soon(done, result, error)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _fail_commands(self, error: EngineDeadError) -> None:
        """Answer every queued command with `error` (the thread will not run them)."""
        while True:
            try:
                _, done = self._commands.get_nowait()
            except queue.Empty:
                return
            if done is not None:
                self._call_soon(done, None, error)

    def _call_soon(self, fn: Callable[..., None], *args: Any) -> None:
        """Run `fn(*args)` on the event loop (from any thread); nothing once the loop closed."""
        if self._loop is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            self._loop.call_soon_threadsafe(fn, *args)
