"""Scheduler driven by a fake sampler (no model): batching limits, chunked prefill, prefix
hits, preemption by recompute, stop conditions. (Abort, prefill-only hold, the decode role and
admission: test_scheduler_lifecycle.py.)"""

from __future__ import annotations

import pytest

from engine.outputs import StepOutput
from engine.request import FinishReason, RequestStatus
from engine.scheduler_output import SchedulerOutput
from tests.unit.engine.scheduler_harness import (
    BLOCK_SIZE,
    EOS,
    fake_token,
    make_request,
    make_scheduler,
    run_to_completion,
    spans,
    step,
)

# ---- batching limits and chunked prefill -------------------------------------------------


def test_token_budget_and_max_num_seqs():
    scheduler = make_scheduler(max_num_batched_tokens=25, max_num_seqs=3)
    requests = [make_request(f"r{i}", 10) for i in range(5)]
    for request in requests:
        scheduler.add_request(request)
    output, _ = step(scheduler)
    assert spans(output) == [("r0", 0, 10, True), ("r1", 0, 10, True), ("r2", 0, 5, False)]
    output, _ = step(scheduler)
    assert spans(output) == [("r0", 10, 1, True), ("r1", 10, 1, True), ("r2", 5, 5, True)]
    assert scheduler.num_waiting == 2

    def check_limits(output: SchedulerOutput) -> None:
        assert output.num_batched_tokens <= 25
        assert len(output.chunks) <= 3

    run_to_completion(scheduler, on_step=check_limits)
    for request in requests:
        assert request.finish_reason is FinishReason.LENGTH
        assert request.output_token_ids == [fake_token(request.request_id, i) for i in range(4)]


def test_chunked_prefill_samples_only_at_the_end():
    scheduler = make_scheduler(max_num_batched_tokens=4)
    request = make_request("r", 10)
    scheduler.add_request(request)
    chunks = [step(scheduler)[0].chunks[0] for _ in range(3)]
    assert [(c.start_pos, c.num_new_tokens, c.sample) for c in chunks] == [
        (0, 4, False),
        (4, 4, False),
        (8, 2, True),
    ]
    assert [c.token_ids for c in chunks] == [request.prompt_token_ids[i : i + 4] for i in (0, 4, 8)]
    for chunk in chunks:
        assert len(chunk.block_ids) * BLOCK_SIZE >= chunk.end_pos
    assert request.output_token_ids == [fake_token("r", 0)]
    run_to_completion(scheduler)


def test_without_chunked_prefill_a_prompt_waits_for_room():
    scheduler = make_scheduler(
        max_model_len=16, max_num_batched_tokens=16, enable_chunked_prefill=False
    )
    scheduler.add_request(make_request("a", 10))
    scheduler.add_request(make_request("b", 10))
    output, _ = step(scheduler)
    assert spans(output) == [("a", 0, 10, True)]  # b does not fit the remaining 6 tokens
    output, _ = step(scheduler)
    assert spans(output) == [("a", 10, 1, True), ("b", 0, 10, True)]
    run_to_completion(scheduler)


def test_without_chunked_prefill_the_budget_must_cover_max_model_len():
    with pytest.raises(ValueError, match="enable chunked prefill, raise max_num_batched_tokens"):
        make_scheduler(max_model_len=32, max_num_batched_tokens=16, enable_chunked_prefill=False)


# ---- prefix cache --------------------------------------------------------------------------


def test_prefix_cache_hit_at_admission():
    scheduler = make_scheduler()
    shared = list(range(10, 22))  # 3 full blocks
    scheduler.add_request(make_request("a", shared + [90, 91]))
    run_to_completion(scheduler)

    scheduler.add_request(make_request("b", shared + [95]))
    scheduler.add_request(make_request("c", shared))  # fully cached: its last block recomputes
    output, step_outputs = step(scheduler)
    assert spans(output) == [("b", 12, 1, True), ("c", 8, 4, True)]
    assert [o.num_cached_tokens for o in step_outputs] == [12, 8]
    stats = scheduler.kv_cache_manager.prefix_cache_stats
    assert (stats.query_tokens, stats.hit_tokens) == (14 + 13 + 12, 20)
    run_to_completion(scheduler)


# ---- preemption by recompute ---------------------------------------------------------------


def test_preempts_the_most_recently_admitted_and_recomputes_its_output():
    scheduler = make_scheduler(num_blocks=4)
    first, second = make_request("a", 8, max_tokens=3), make_request("b", 8, max_tokens=3)
    scheduler.add_request(first)
    scheduler.add_request(second)
    step(scheduler)  # both prompts fill the pool exactly
    output, _ = step(scheduler)  # a's decode needs a 3rd block: b gives its blocks back
    assert output.preempted_request_ids == ["b"]
    assert spans(output) == [("a", 8, 1, True)]
    assert second.status is RequestStatus.PREEMPTED
    assert (second.num_computed_tokens, second.num_preemptions) == (0, 1)
    assert second.block_ids == []
    assert second.output_token_ids == [fake_token("b", 0)]  # kept

    step(scheduler)  # a finishes
    output, _ = step(scheduler)
    (chunk,) = output.chunks
    # b recomputes prompt + its first output token (after a prefix hit), then samples the next.
    assert chunk.request is second and chunk.sample
    assert (chunk.start_pos, chunk.end_pos) == (4, 9)  # its head block was still cached
    assert chunk.token_ids == second.prompt_token_ids[4:] + [fake_token("b", 0)]
    run_to_completion(scheduler)
    assert second.output_token_ids == [fake_token("b", i) for i in range(3)]
    assert scheduler.num_preemptions == 1


def test_a_request_that_cannot_grow_preempts_itself():
    scheduler = make_scheduler(num_blocks=4)
    scheduler.add_request(make_request("a", 7, max_tokens=3))
    scheduler.add_request(make_request("b", 8, max_tokens=3))
    step(scheduler)
    output, _ = step(scheduler)  # a fits its 2 blocks; b, the last admitted, needs a 3rd
    assert output.preempted_request_ids == ["b"]
    assert spans(output) == [("a", 7, 1, True)]
    run_to_completion(scheduler)


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("budget", [8, 64])
def test_tiny_pool_gives_the_same_tokens_as_a_big_pool(prefix_caching, budget):
    def run(num_blocks: int) -> tuple[dict[str, list[int]], int]:
        scheduler = make_scheduler(
            num_blocks, prefix_caching=prefix_caching, max_num_batched_tokens=budget
        )
        for i in range(8):
            scheduler.add_request(make_request(f"r{i}", 5 + 2 * i, max_tokens=6 + i % 4))
        return run_to_completion(scheduler), scheduler.num_preemptions

    expected, num_preemptions = run(num_blocks=256)
    assert num_preemptions == 0
    tokens, num_preemptions = run(num_blocks=8)
    assert num_preemptions > 0
    assert tokens == expected
    assert expected == {
        f"r{i}": [fake_token(f"r{i}", n) for n in range(6 + i % 4)] for i in range(8)
    }


# ---- stop conditions -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "script", "expected", "reason"),
    [
        (dict(max_tokens=8), [5, EOS, 7], [5, EOS], FinishReason.STOP),
        (dict(max_tokens=3, ignore_eos=True), [5, EOS, 7], [5, EOS, 7], FinishReason.LENGTH),
        (dict(max_tokens=8, stop_token_ids=[7]), [5, 7, 9], [5, 7], FinishReason.STOP),
        (
            dict(max_tokens=8, min_tokens=3, stop_token_ids=[7]),
            [EOS, 7, EOS, 8],
            [EOS, 7, EOS],
            FinishReason.STOP,
        ),
        (dict(max_tokens=3), [5, 6, 8, 9], [5, 6, 8], FinishReason.LENGTH),
        (dict(max_tokens=2), [5, EOS], [5, EOS], FinishReason.STOP),  # stop wins over length
        (dict(max_tokens=8), [5, 6, 8, 9, 11], [5, 6, 8, 9], FinishReason.LENGTH),  # model len
    ],
    ids=["eos", "ignore_eos", "stop_token", "min_tokens", "max_tokens", "eos_at_max", "model_len"],
)
def test_stop_conditions(params, script, expected, reason):
    scheduler = make_scheduler(max_model_len=10)
    request = make_request("r", 6, **params)
    scheduler.add_request(request)
    outputs: list[StepOutput] = []
    while scheduler.has_unfinished():
        outputs += step(scheduler, lambda _, index: script[index])[1]
    assert [t for o in outputs for t in o.new_token_ids] == expected
    assert [o.finish_reason for o in outputs] == [None] * (len(expected) - 1) + [reason]
    assert request.output_token_ids == expected
    assert request.finish_reason is reason
    scheduler.kv_cache_manager.check_no_leaks()
