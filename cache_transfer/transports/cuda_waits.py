"""Awaiting CUDA work from an event loop without holding the GIL.

    await wait_event(event, timeout_s)   done already ──► returns at once (no thread hop)
                                         else ──► one waiter thread: event.synchronize()
                                              (GIL released) ──► loop.call_soon_threadsafe
    await wait_for_stream(tensor, t)     an event recorded on the tensor's device's current
                                         stream, then wait_event

Every wait takes a timeout (TimeoutError): a hung device must not hang a transfer's task.

Why not poll `event.query()` with `asyncio.sleep(0)`: the loop then spins, retaking the GIL in
every select() while the node's engine thread needs it to queue the next layer's kernels (a
thread that wants the GIL from a spinning one can wait up to the switch interval, 5 ms);
sleeping between polls instead adds up to one sleep of latency to every layer sent. (On one
H200 the change did not move TTFT measurably; the slowdown it was suspected of came from GPU
time-slicing: benchmarks/results/2026-12-02-h200-kv-handoff.txt, runs 5-7.)

One daemon thread per process serves every loop, first come first served (CUDA work on one
device finishes in the order it was queued, nearly always).
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading

import torch

_Job = tuple[torch.cuda.Event, asyncio.AbstractEventLoop, asyncio.Future[None]]
_jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
_start_lock = threading.Lock()
_waiter: threading.Thread | None = None


async def wait_event(event: torch.cuda.Event, timeout_s: float) -> None:
    """Until the work recorded by `event` is done; TimeoutError after `timeout_s` (the wait in
    the waiter thread goes on, harmlessly: it holds nothing). CUDA errors raise here."""
    if event.query():  # type: ignore[no-untyped-call]  # torch leaves Event.query unannotated
        return
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    done.add_done_callback(_retrieve)  # a CUDA error after the caller gave up is not news
    _ensure_waiter()
    _jobs.put((event, loop, done))
    async with asyncio.timeout(timeout_s):
        await asyncio.shield(done)


async def wait_for_stream(tensor: torch.Tensor, timeout_s: float) -> None:
    """For a CUDA tensor: until the work queued so far on its device's current stream is done.
    Nothing to wait for on the host."""
    if tensor.device.type != "cuda":
        return
    event = new_event()
    event.record(torch.cuda.current_stream(tensor.device))
    await wait_event(event, timeout_s)


def new_event() -> torch.cuda.Event:
    """A CUDA event on the current device (typed: torch leaves Event's constructor unannotated)."""
    return torch.cuda.Event()  # type: ignore[no-untyped-call]


def _ensure_waiter() -> None:
    global _waiter
    if _waiter is not None:
        return
    with _start_lock:
        if _waiter is None:
            thread = threading.Thread(target=_serve, name="cuda-event-waiter", daemon=True)
            thread.start()
            _waiter = thread


def _serve() -> None:
    while True:
        event, loop, done = _jobs.get()
        try:
            event.synchronize()  # releases the GIL while it waits
            outcome: BaseException | None = None
        except BaseException as error:  # a CUDA error belongs to the awaiting coroutine
            outcome = error
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
            loop.call_soon_threadsafe(_settle, done, outcome)


def _settle(done: asyncio.Future[None], outcome: BaseException | None) -> None:
    if done.done():
        return
    if outcome is None:
        done.set_result(None)
    else:
        done.set_exception(outcome)


def _retrieve(done: asyncio.Future[None]) -> None:
    if not done.cancelled():
        done.exception()
