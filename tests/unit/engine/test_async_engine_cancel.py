"""A cancelled call racing the engine's pick-up never leaves the request in the engine.

The race (issue 15's cancel storm): `AsyncEngine.generate` queues `add_request` for the engine
thread; the caller is cancelled while the command waits. The command still runs, the
prefill-only engine prefills the request and holds it PREFILLED with its blocks, and nobody is
left to release it. The order is forced by holding the engine thread (`engine.testing`), not
with sleeps."""

from __future__ import annotations

import asyncio

import pytest

from engine.async_engine import AsyncEngine
from engine.engine_core import EngineCore
from engine.testing import hold_engine_thread, num_queued_commands, on_engine_thread
from pdserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pdserve.sampling_params import SamplingParams

WAIT_S = 10.0


def _core(prefill_only: bool) -> EngineCore:
    return EngineCore(
        EngineConfig(
            model=ModelConfig(model="synthetic:tiny-llama", device="cpu", dtype="float32"),
            cache=CacheConfig(block_size=4, num_blocks=32),
            scheduler=SchedulerConfig(prefill_only=prefill_only),
        )
    )


async def _until_queued(engine: AsyncEngine, num_commands: int) -> None:
    async with asyncio.timeout(WAIT_S):
        while num_queued_commands(engine) < num_commands:
            await asyncio.sleep(0)


@pytest.mark.parametrize("prefill_only", [True, False], ids=["prefill-only", "decode"])
def test_generate_cancelled_before_pick_up_frees_everything(prefill_only):
    core = _core(prefill_only)

    async def body():
        engine = AsyncEngine(core)
        engine.start()
        try:
            release = await hold_engine_thread(engine, WAIT_S)
            request = core.make_request(
                "r1", list(range(3, 40)), SamplingParams(max_tokens=4, ignore_eos=True)
            )

            async def consume():
                async for _ in engine.generate(request):
                    pass

            task = asyncio.create_task(consume())
            await _until_queued(engine, 1)  # add_request waits behind the held command
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            release.set()  # add_request runs now, after its caller is gone
            for _ in range(3):  # let the engine step whatever it holds
                stats = await engine.stats()
            return stats, await on_engine_thread(engine, lambda c: c.get_request("r1"))
        finally:
            await engine.stop()

    stats, leftover = asyncio.run(asyncio.wait_for(body(), 60))
    assert leftover is None
    assert stats.num_free_blocks == stats.num_total_blocks
    assert stats.num_prefilled_held == 0 and stats.num_running == stats.num_waiting == 0


def test_a_reused_id_is_not_aborted_by_a_cancelled_duplicate():
    """The abort queued for a cancelled add only ever touches that call's own request."""
    core = _core(prefill_only=True)

    async def body():
        engine = AsyncEngine(core)
        engine.start()
        try:
            params = SamplingParams(max_tokens=4, ignore_eos=True)
            first = core.make_request("same", list(range(3, 20)), params)
            release = await hold_engine_thread(engine, WAIT_S)
            on_engine_thread(engine, lambda c: c.add_request(first))  # another call holds the id
            duplicate = core.make_request("same", list(range(3, 20)), params)

            async def consume() -> None:
                async for _ in engine.generate(duplicate):
                    pass

            add = asyncio.create_task(consume())
            await _until_queued(engine, 2)
            add.cancel()
            with pytest.raises(asyncio.CancelledError):
                await add
            release.set()
            return await on_engine_thread(engine, lambda c: c.get_request("same"))
        finally:
            await engine.stop()

    held = asyncio.run(asyncio.wait_for(body(), 60))
    assert held is not None and held.status.name == "PREFILLED"  # still the first call's
