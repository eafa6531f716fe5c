"""The scheduler under speculative decoding, with a scripted proposer and a fake target (no
model): draft slots in the budget, the accepted run landed with its stop checks, the rejected
drafts' KV rolled back exactly (computed tokens, blocks, prefix cache), no preemption for a
draft slot, no step scheduled ahead while a request speculates."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest

from engine.kv_cache_manager import KVCacheManager
from engine.scheduler import Scheduler
from engine.scheduler_output import ScheduledChunk, SchedulerOutput
from engine.spec_decode import Proposer, SpecDecoder
from pdserve.config import SchedulerConfig
from tests.unit.engine.scheduler_harness import (
    BLOCK_SIZE,
    EOS,
    fake_sampled,
    fake_token,
    make_request,
    run_to_completion,
)

WRONG = 7  # never a fake token (those are 100..149)


class ScriptedProposer(Proposer):
    """Drafts the fake target's own tokens, wrong from the `wrong_at`-th draft on (None: all
    right); records what it was asked."""

    name = "scripted"

    def __init__(self, wrong_at: int | None, sampler=fake_token) -> None:
        self.wrong_at = wrong_at
        self.sampler = sampler
        self.asked: list[tuple[str, int]] = []  # (request id, draft slots)

    def propose(self, chunks: Sequence[ScheduledChunk]) -> list[list[int]]:
        drafts = []
        for chunk in chunks:
            request = chunk.request
            self.asked.append((request.request_id, chunk.num_lookahead_tokens))
            n = len(request.output_token_ids)
            right = [
                self.sampler(request.request_id, n + j) for j in range(chunk.num_lookahead_tokens)
            ]
            if self.wrong_at is not None:
                right[self.wrong_at :] = [WRONG] * len(right[self.wrong_at :])
            drafts.append(right)
        return drafts


def make_spec_scheduler(
    proposer: Proposer, k: int = 4, num_blocks: int = 64, prefix_caching: bool = True, **config
) -> tuple[Scheduler, SpecDecoder]:
    spec = SpecDecoder(proposer, k)
    kv_cache_manager = KVCacheManager(num_blocks, BLOCK_SIZE, prefix_caching)
    return Scheduler(SchedulerConfig(**config), kv_cache_manager, 256, spec), spec


def verified(output: SchedulerOutput, sampler=fake_token) -> dict:
    """The fake target at every position of each verify chunk: x_j at output index n + j."""
    result = {}
    for chunk in output.chunks:
        if chunk.num_draft_tokens:
            request = chunk.request
            n = len(request.output_token_ids)
            result[request.request_id] = [
                (sampler(request.request_id, n + j), None)
                for j in range(chunk.num_draft_tokens + 1)
            ]
    return result


class SpecDriver:
    """`run_to_completion`'s scheduler interface, with drafts filled and verify rows given;
    checks the ledger after every step."""

    def __init__(self, scheduler: Scheduler, spec: SpecDecoder, sampler=fake_token) -> None:
        self.scheduler, self.spec, self.sampler = scheduler, spec, sampler
        self.outputs: list[SchedulerOutput] = []
        self.kv_cache_manager = scheduler.kv_cache_manager

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def schedule(self) -> SchedulerOutput:
        output = self.scheduler.schedule()
        self.spec.fill_drafts(output, self.scheduler.kv_cache_manager)
        self.outputs.append(output)
        return output

    def on_launched(self, output: SchedulerOutput) -> None:
        self.scheduler.on_launched(output)

    def update_from_output(self, output: SchedulerOutput, sampled: dict):
        step_outputs = self.scheduler.update_from_output(
            output, sampled, verified(output, self.sampler)
        )
        for chunk in output.chunks:
            request = chunk.request
            if chunk.num_draft_tokens and request.status.name == "RUNNING":
                assert request.num_computed_tokens == request.num_tokens - 1
                assert len(request.block_ids) == math.ceil(request.num_computed_tokens / BLOCK_SIZE)
        return step_outputs


def drive(driver: SpecDriver, sampler=fake_token) -> dict[str, list[int]]:
    return run_to_completion(driver, sampler)  # type: ignore[arg-type]


def plain_tokens(requests_args, sampler=fake_token, **config) -> dict[str, list[int]]:
    kv_cache_manager = KVCacheManager(64, BLOCK_SIZE, True)
    scheduler = Scheduler(SchedulerConfig(**config), kv_cache_manager, 256)
    for args, params in requests_args:
        scheduler.add_request(make_request(*args, **params))
    return run_to_completion(scheduler, sampler)


REQUESTS = [
    (("a", 9), dict(max_tokens=23)),
    (("b", 3), dict(max_tokens=3)),  # one draft slot at most
    (("c", 17), dict(max_tokens=12)),
    (("d", 5), dict(max_tokens=1)),  # finishes on its first token: never drafts
    (("e", 6), dict(max_tokens=17, speculative=False)),  # opted out
]


@pytest.mark.parametrize("wrong_at", [None, 0, 1, 3], ids=["all-right", "none", "one", "three"])
def test_accepted_runs_give_the_plain_tokens_and_roll_back_exactly(wrong_at) -> None:
    expected = plain_tokens(REQUESTS)
    proposer = ScriptedProposer(wrong_at)
    scheduler, spec = make_spec_scheduler(proposer)
    for args, params in REQUESTS:
        scheduler.add_request(make_request(*args, **params))
    driver = SpecDriver(scheduler, spec)
    assert drive(driver) == expected  # (run_to_completion checks no block leaked)
    asked = dict(proposer.asked)
    assert "d" not in asked and "e" not in asked and asked["b"] == 1
    stats = spec.stats
    assert stats.num_verifies > 0 and stats.num_draft_tokens > 0
    if wrong_at == 0:
        assert stats.num_accepted_tokens == 0
    if wrong_at is None:
        assert stats.num_accepted_tokens == stats.num_draft_tokens
        # 23 tokens of "a": the first from its prefill, then runs of up to 5 (K + 1)
        assert sum(1 for o in driver.outputs for c in o.chunks if c.request.request_id == "a") < 10


def test_prefix_cache_holds_the_blocks_of_accepted_tokens_only() -> None:
    """The hashed blocks of a speculative run are those of the plain run: no block holding a
    rejected draft is ever registered, and the rest are."""
    hashed = {}
    for wrong_at in ("plain", 1):
        kv_cache_manager = KVCacheManager(64, BLOCK_SIZE, True)
        if wrong_at == "plain":
            scheduler = Scheduler(SchedulerConfig(), kv_cache_manager, 256)
            run = scheduler
        else:
            spec = SpecDecoder(ScriptedProposer(wrong_at), 4)
            scheduler = Scheduler(SchedulerConfig(), kv_cache_manager, 256, spec)
            run = SpecDriver(scheduler, spec)
        scheduler.add_request(make_request("a", 6, max_tokens=30))
        run_to_completion(run)  # type: ignore[arg-type]
        hashed[wrong_at] = set(kv_cache_manager._cached)  # noqa: SLF001
    assert hashed[1] == hashed["plain"] and len(hashed["plain"]) == (6 + 30 - 1) // BLOCK_SIZE


def eos_at(index: int):
    def sampler(request_id: str, i: int) -> int:
        return EOS if request_id == "a" and i == index else fake_token(request_id, i)

    return sampler


@pytest.mark.parametrize("index", [1, 2, 4])
def test_a_stop_inside_an_accepted_run_ends_the_request_there(index) -> None:
    """EOS and a stop token land inside the drafts (all accepted): the request stops at that
    token, the tokens after it are dropped, its blocks are freed."""
    sampler = eos_at(index)
    args = [
        (("a", 5), dict(max_tokens=20)),
        (("b", 5), dict(max_tokens=20, stop_token_ids=[fake_token("b", 3)])),
    ]
    expected = plain_tokens(args, sampler)
    assert expected["a"][-1] == EOS and len(expected["a"]) == index + 1
    scheduler, spec = make_spec_scheduler(ScriptedProposer(None, sampler))
    for a, params in args:
        scheduler.add_request(make_request(*a, **params))
    assert drive(SpecDriver(scheduler, spec, sampler), sampler) == expected
    assert len(expected["b"]) == 4
    assert spec.stats.num_emitted_tokens < spec.stats.num_accepted_tokens + spec.stats.num_verifies


def test_draft_slots_count_in_the_budget() -> None:
    scheduler, spec = make_spec_scheduler(ScriptedProposer(None), k=4, max_num_batched_tokens=3)
    request = make_request("a", 2, max_tokens=10)
    scheduler.add_request(request)
    driver = SpecDriver(scheduler, spec)
    output = driver.schedule()  # the prompt
    driver.on_launched(output)
    driver.update_from_output(output, fake_sampled(output))
    output = driver.schedule()
    (chunk,) = output.chunks
    assert (chunk.num_lookahead_tokens, chunk.num_draft_tokens, chunk.num_new_tokens) == (2, 2, 3)


def test_a_draft_slot_never_preempts() -> None:
    """A pool with room for the decodes but not their drafts: plain decodes, nobody preempted."""
    scheduler, spec = make_spec_scheduler(ScriptedProposer(None), k=4, num_blocks=4)
    for name in ("a", "b"):
        scheduler.add_request(make_request(name, 7, max_tokens=4))  # 2 blocks each, then full
    driver = SpecDriver(scheduler, spec)
    output = driver.schedule()
    driver.on_launched(output)
    driver.update_from_output(output, fake_sampled(output))
    output = driver.schedule()
    assert [c.num_lookahead_tokens for c in output.chunks] == [0, 0]
    assert not output.preempted_request_ids and scheduler.num_preemptions == 0


def test_no_step_is_scheduled_ahead_while_a_request_speculates() -> None:
    scheduler, spec = make_spec_scheduler(ScriptedProposer(None))
    scheduler.add_request(make_request("a", 5, max_tokens=10, speculative=False))
    output = scheduler.schedule()
    scheduler.on_launched(output)
    assert scheduler.schedule_ahead() is not None  # only an opted-out request runs
    scheduler.add_request(make_request("b", 5, max_tokens=10))
    while scheduler.has_unfinished() and all(r != "b" for r in scheduler._running):  # noqa: SLF001
        scheduler.update_from_output(output, fake_sampled(output))
        output = scheduler.schedule()
        scheduler.on_launched(output)
    assert scheduler.schedule_ahead() is None


def test_handed_in_drafts_are_verified_first() -> None:
    """Drafts that came with the request (a hand-off) are the first verify step's."""
    proposer = ScriptedProposer(0)  # its own drafts are all wrong
    scheduler, spec = make_spec_scheduler(proposer)
    request = make_request("a", 9, max_tokens=10)
    request.block_ids = scheduler.kv_cache_manager.reserve(request.prompt_len + 1)
    request.num_computed_tokens = request.prompt_len
    request.output_token_ids = [fake_token("a", 0)]
    request.draft_token_ids = [fake_token("a", j) for j in (1, 2, 3)]
    scheduler.add_prefilled(request)
    driver = SpecDriver(scheduler, spec)
    output = driver.schedule()
    (chunk,) = output.chunks
    assert chunk.token_ids[1:] == [fake_token("a", j) for j in (1, 2, 3)]
    assert not request.draft_token_ids and not proposer.asked
    driver.on_launched(output)
    (step_output,) = driver.update_from_output(output, fake_sampled(output))
    assert step_output.new_token_ids == [fake_token("a", j) for j in (1, 2, 3, 4)]


class ShortProposer(ScriptedProposer):
    """The fake target's tokens, at most `num` of them (0: no draft)."""

    def __init__(self, num: int) -> None:
        super().__init__(None)
        self.num = num

    def propose(self, chunks: Sequence[ScheduledChunk]) -> list[list[int]]:
        return [drafts[: self.num] for drafts in super().propose(chunks)]


@pytest.mark.parametrize("num", [0, 1])
def test_slots_left_without_a_draft_give_their_blocks_back_at_once(num: int) -> None:
    """Slots for 4 drafts, fewer found: the blocks only the empty slots needed are freed before
    the step runs (no request holds blocks it will not write)."""
    expected = plain_tokens([(("a", 3), dict(max_tokens=12))])
    scheduler, spec = make_spec_scheduler(ShortProposer(num), k=4)
    scheduler.add_request(make_request("a", 3, max_tokens=12))
    driver = SpecDriver(scheduler, spec)
    tokens: list[int] = []
    while scheduler.has_unfinished():
        output = driver.schedule()
        for chunk in output.chunks:
            needed = chunk.start_pos + chunk.num_new_tokens
            assert len(chunk.request.block_ids) == math.ceil(needed / BLOCK_SIZE)
            assert chunk.num_draft_tokens == min(num, chunk.num_lookahead_tokens)
        driver.on_launched(output)
        for out in driver.update_from_output(output, fake_sampled(output)):
            tokens += out.new_token_ids
    assert tokens == expected["a"]
    scheduler.kv_cache_manager.check_no_leaks()
