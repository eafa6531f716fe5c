"""On CUDA the engine thread's waits for the GPU must release the GIL: the node's event loop
(KV sends, token streaming, heartbeats) runs in the same process and would otherwise stall for
a whole step. Checked by counting a Python thread's ticks while the engine thread waits."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from engine.host_copy import to_host_list
from engine.request import Request
from engine.sampler import Sampler
from pdserve.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

BUSY_S = 0.2  # GPU work queued before the wait: long enough for a ticking thread to show


def _queue_gpu_work(seconds: float) -> torch.Tensor:
    """Queue about `seconds` of matmuls on the current stream; return their last output."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):  # cuBLAS set up, clocks up
        a @ a
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(5):
        a @ a
    torch.cuda.synchronize()
    per_matmul_s = max((time.perf_counter() - start) / 5, 1e-5)
    out = a
    for _ in range(int(seconds / per_matmul_s) + 1):
        out = a @ a
    return out


def _ticks_while(wait) -> int:
    """How many times a Python thread ran (every ~1 ms) while `wait()` blocked."""
    ticks, stop = [0], threading.Event()

    def tick() -> None:
        while not stop.is_set():
            ticks[0] += 1
            time.sleep(0.001)

    thread = threading.Thread(target=tick)
    thread.start()
    try:
        wait()
    finally:
        stop.set()
        thread.join()
    return ticks[0]


def test_to_host_list_releases_the_gil():
    to_host_list(torch.zeros(4, device="cuda"))  # the first pinned allocation syncs (as in
    # the engine's first step); later ones reuse the cached block
    out = _queue_gpu_work(BUSY_S)
    ticks = _ticks_while(lambda: to_host_list(out[0, :4]))
    assert ticks >= 20, f"another thread ran only {ticks} times in a {BUSY_S}s GPU wait"


def test_event_synchronize_releases_the_gil():  # what the prefill hook's run-ahead bound uses
    out = _queue_gpu_work(BUSY_S)
    event = torch.cuda.Event()
    event.record()
    ticks = _ticks_while(event.synchronize)
    del out
    assert ticks >= 20, f"another thread ran only {ticks} times in a {BUSY_S}s event wait"


def test_sampler_copy_releases_the_gil():
    logits = _queue_gpu_work(BUSY_S)[:2].float()
    requests = [Request(f"r{i}", [1, 2, 3], SamplingParams(temperature=0.0)) for i in range(2)]
    Sampler()(logits.clone(), requests)  # first use: pinned host blocks allocated (a sync),
    # cached for every later step as in the engine
    logits = _queue_gpu_work(BUSY_S)[:2].float()
    ticks = _ticks_while(lambda: Sampler()(logits, requests))
    assert ticks >= 20, f"another thread ran only {ticks} times while the sampler waited"


def test_event_loop_waits_for_cuda_without_holding_the_gil():
    """cuda_waits: while a coroutine awaits a busy event, another Python thread (the engine
    thread, in a node) runs freely and the loop serves its other tasks."""
    import asyncio

    from cache_transfer.transports.cuda_waits import wait_event, wait_for_stream

    async def waits() -> int:
        loop_ticks = [0]

        async def tick_loop() -> None:
            while True:
                loop_ticks[0] += 1
                await asyncio.sleep(0.001)

        ticker = asyncio.create_task(tick_loop())
        await wait_event(event, timeout_s=10)
        ticker.cancel()
        await wait_for_stream(torch.zeros(1, device="cuda"), timeout_s=10)
        return loop_ticks[0]

    out = _queue_gpu_work(BUSY_S)
    event = torch.cuda.Event()
    event.record()
    loop_ticks = [0]
    thread_ticks = _ticks_while(lambda: loop_ticks.__setitem__(0, asyncio.run(waits())))
    del out
    assert event.query()
    assert thread_ticks >= 20, f"another thread ran only {thread_ticks} times in the wait"
    assert loop_ticks[0] >= 20, f"the event loop ran its other task only {loop_ticks[0]} times"


def test_event_wait_times_out_and_the_loop_goes_on():
    import asyncio

    from cache_transfer.transports.cuda_waits import wait_event

    out = _queue_gpu_work(BUSY_S)
    event = torch.cuda.Event()
    event.record()

    async def main() -> None:
        with pytest.raises(TimeoutError):
            await wait_event(event, timeout_s=0.01)
        await wait_event(event, timeout_s=10)  # the same event, later: done

    asyncio.run(main())
    del out
    assert event.query()
