"""`KVAdmission` against a stand-in engine whose answers arrive after the question, as the real
engine thread's do: concurrent admissions never promise the same room twice, and a caller's
wait is bounded by what it asks for."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from decode_node.kv_admission import AdmissionRefused, KVAdmission
from engine.engine_core import NoFreeBlocksError

pytestmark = pytest.mark.timeout(60)

BLOCK_SIZE = 4


class _Engine:
    """A stand-in `AsyncEngine` whose answers come a loop turn after the question (as the engine
    thread's do), so two callers can both hold an answer before either acts on it."""

    def __init__(self, num_free_blocks: int) -> None:
        self.num_free_blocks = num_free_blocks

    async def stats(self) -> SimpleNamespace:
        await asyncio.sleep(0)
        return SimpleNamespace(num_free_blocks=self.num_free_blocks, num_running=0, num_waiting=0)

    async def reserve(self, request_id: str, num_tokens: int) -> list[int]:
        await asyncio.sleep(0)
        raise NoFreeBlocksError(f"no room for {request_id}")


def _admission(num_free_blocks: int, max_num_seqs: int = 8, queue_timeout_s: float = 30.0):
    engine: Any = _Engine(num_free_blocks)
    return KVAdmission(
        engine, BLOCK_SIZE, max_num_seqs, max_queued=4, queue_timeout_s=queue_timeout_s
    )


@pytest.mark.parametrize(
    ("num_free_blocks", "max_num_seqs"),
    [(3, 8), (100, 1)],  # room for one prompt of 3 blocks; or blocks for many but one seat
)
def test_concurrent_local_admissions_never_share_the_same_room(num_free_blocks, max_num_seqs):
    async def scenario() -> None:
        admission = _admission(num_free_blocks, max_num_seqs)
        first = asyncio.create_task(admission.admit_local(2 * BLOCK_SIZE))  # 3 blocks with +1
        second = asyncio.create_task(admission.admit_local(2 * BLOCK_SIZE))
        done, pending = await asyncio.wait({first, second}, timeout=1.0)
        assert len(done) == 1 and len(pending) == 1  # one admitted, the other queued
        assert admission.num_queued == 1
        admitted = done.pop().result()
        assert admission.num_promised_blocks == 3 and admission.num_promised_seats == 1
        admitted.done()  # its blocks are the engine's now: the queued one may go
        async with asyncio.timeout(5):
            later = await pending.pop()
        assert admission.num_promised_blocks == 3 and admission.num_promised_seats == 1
        later.done()
        later.done()  # idempotent
        assert admission.num_promised_blocks == 0 and admission.num_promised_seats == 0

    asyncio.run(scenario())


def test_reserve_waits_no_longer_than_asked():
    async def scenario() -> None:
        admission = _admission(num_free_blocks=0, queue_timeout_s=600.0)
        async with asyncio.timeout(10):  # the queue timeout alone would wait 600 s
            with pytest.raises(AdmissionRefused, match="no KV blocks freed up"):
                await admission.reserve(SimpleNamespace(request_id="r1"), 16, wait_s=0.05)
        assert admission.num_queued == 0 and admission.num_refused == 1

    asyncio.run(scenario())
