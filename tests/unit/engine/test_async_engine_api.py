"""`AsyncEngine` without a fixed timeout: an abort ends a stream at once even while the engine
thread is busy (in a step, or in a command), the engine frees the request when it gets there,
and outputs it publishes for the aborted request before that never reach a new request of the
same id; `abort_nowait(at_once=False)` lets the step under way deliver first; when the engine
thread ends (stopped, or a step raised) every waiter gets EngineDeadError instead of hanging.
Orders are forced with events on the engine thread, not with sleeps."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

import pytest

from engine.async_engine import AsyncEngine, EngineDeadError
from engine.engine_core import EngineCore
from engine.outputs import PrefillLayerChunk, StepOutput
from engine.request import FinishReason, Request
from engine.testing import hold_engine_thread
from pdserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pdserve.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(60)

WAIT_S = 10.0
PARAMS = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


def _engine(prefill_only: bool = False, prefix_caching: bool = True) -> AsyncEngine:
    core = EngineCore(
        EngineConfig(
            model=ModelConfig(model="synthetic:tiny-llama", device="cpu", dtype="float32"),
            cache=CacheConfig(block_size=4, num_blocks=32, enable_prefix_caching=prefix_caching),
            scheduler=SchedulerConfig(prefill_only=prefill_only),
        )
    )
    return AsyncEngine(core)


def _request(engine: AsyncEngine, request_id: str, first_id: int = 3) -> Request:
    return engine.make_request(request_id, list(range(first_id, first_id + 9)), PARAMS)


async def _collect(outputs: AsyncIterator[StepOutput]) -> list[StepOutput]:
    return [out async for out in outputs]


class _HeldStep:
    """Parks the engine thread in the step that prefills `request_id` (at its layer 0)."""

    def __init__(self, engine: AsyncEngine, request_id: str) -> None:
        self.entered, self.released = threading.Event(), threading.Event()

        def hook(layer_idx: int, chunks: tuple[PrefillLayerChunk, ...]) -> None:
            if layer_idx == 0 and any(c.request_id == request_id for c in chunks):
                self.entered.set()
                self.released.wait(WAIT_S)

        engine.core.on_layer_done = hook

    async def wait_entered(self) -> None:
        assert await asyncio.to_thread(self.entered.wait, WAIT_S)


async def _all_free(engine: AsyncEngine) -> None:
    stats = await engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    await engine.check_no_leaks()


def test_an_abort_ends_a_queued_stream_while_the_engine_thread_is_busy() -> None:
    async def body() -> None:
        engine = _engine()
        engine.start()
        try:
            release = await hold_engine_thread(engine, WAIT_S)
            consumer = asyncio.create_task(_collect(engine.generate(_request(engine, "q"))))
            await asyncio.sleep(0)  # its add is queued behind the held command
            assert await engine.abort("q")  # known: it has a stream
            (out,) = await asyncio.wait_for(consumer, WAIT_S)  # while the thread is held
            assert out.finish_reason == FinishReason.ABORT
            release.set()
            await _all_free(engine)  # the add ran, then the abort
        finally:
            await engine.stop()

    asyncio.run(body())


def test_an_aborted_requests_late_outputs_never_reach_a_new_request_of_its_id() -> None:
    async def body() -> None:
        engine = _engine(prefix_caching=False)  # "ref" and the new "x" compute alike
        engine.start()
        try:
            reference = await _collect(engine.generate(_request(engine, "ref", first_id=50)))
            held = _HeldStep(engine, "x")
            old = asyncio.create_task(_collect(engine.generate(_request(engine, "x"))))
            await held.wait_entered()  # the step computes the old "x"
            assert await engine.abort("x")
            assert (await asyncio.wait_for(old, WAIT_S))[-1].finish_reason == FinishReason.ABORT
            new = asyncio.create_task(_collect(engine.generate(_request(engine, "x", first_id=50))))
            await asyncio.sleep(0)
            held.released.set()  # the old "x" samples a token in this step: stale, dropped
            outputs = await asyncio.wait_for(new, WAIT_S)
            tokens = [t for out in outputs for t in out.new_token_ids]
            assert tokens == [t for out in reference for t in out.new_token_ids]
            await _all_free(engine)
        finally:
            await engine.stop()

    asyncio.run(body())


@pytest.mark.parametrize("at_once", [True, False])
def test_abort_nowait_at_once_or_after_the_step_under_way(at_once: bool) -> None:
    """A prefill-only engine: aborted during the step that prefills it, the request's stream
    ends at once (ABORT), or after the step (its first token comes first); freed either way."""

    async def body() -> None:
        engine = _engine(prefill_only=True)
        engine.start()
        try:
            held = _HeldStep(engine, "p")
            stream = asyncio.create_task(_collect(engine.generate(_request(engine, "p"))))
            await held.wait_entered()
            engine.abort_nowait("p", at_once=at_once)
            if at_once:
                (out,) = await asyncio.wait_for(stream, WAIT_S)  # the step still runs
                assert out.finish_reason == FinishReason.ABORT
            held.released.set()
            if not at_once:
                (out,) = await asyncio.wait_for(stream, WAIT_S)
                assert out.prefill_done and len(out.new_token_ids) == 1
            await _all_free(engine)  # the abort ran after the step: the held blocks are free
        finally:
            await engine.stop()

    asyncio.run(body())


def test_a_stopped_engine_fails_its_streams_and_later_calls() -> None:
    async def body() -> None:
        engine = _engine()
        engine.start()
        long = engine.make_request("long", list(range(3, 12)), SamplingParams(max_tokens=100))
        stream = engine.generate(long)
        await anext(stream)  # it runs
        await engine.stop()
        with pytest.raises(EngineDeadError):
            async with asyncio.timeout(WAIT_S):
                async for _ in stream:
                    pass
        with pytest.raises(EngineDeadError):
            await engine.stats()
        assert not await engine.abort("long")  # nothing is held any more
        engine.abort_nowait("long")  # cleanup after the engine's end raises nothing
        engine.release_nowait("long")

    asyncio.run(body())


def test_a_step_that_raises_fails_every_waiter() -> None:
    async def body() -> None:
        engine = _engine()

        def broken_step() -> list[StepOutput]:
            raise RuntimeError("the device went away")

        engine.core.step = broken_step  # type: ignore[method-assign]
        engine.start()
        try:
            with pytest.raises(EngineDeadError, match="the device went away"):
                async with asyncio.timeout(WAIT_S):
                    await _collect(engine.generate(_request(engine, "r")))
            with pytest.raises(EngineDeadError):
                await engine.reserve("r2", 4)
        finally:
            await engine.stop()

    asyncio.run(body())
