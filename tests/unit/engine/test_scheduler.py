"""Scheduler driven by a fake sampler (no model): batching limits, chunked prefill, prefix
hits, preemption by recompute, stop conditions, abort, prefill-only hold and the decode role."""

from __future__ import annotations

import zlib
from collections.abc import Callable

import pytest

from engine.kv_cache_manager import KVCacheManager
from engine.outputs import StepOutput
from engine.request import FinishReason, Request, RequestStatus
from engine.scheduler import Scheduler
from engine.scheduler_output import SchedulerOutput
from pdserve.config import SchedulerConfig
from pdserve.sampling_params import InvalidRequestError, SamplingParams

BLOCK_SIZE = 4
EOS = 2
Sampler = Callable[[str, int], int]  # (request_id, output index) -> token id


def fake_token(request_id: str, index: int) -> int:
    """Deterministic per (request, output index), never EOS, whatever the batch."""
    return 100 + (sum(map(ord, request_id)) * 7 + index * 13) % 50


def make_scheduler(
    num_blocks: int = 64, max_model_len: int = 256, prefix_caching: bool = True, **config
) -> Scheduler:
    kv_cache_manager = KVCacheManager(num_blocks, BLOCK_SIZE, prefix_caching)
    return Scheduler(SchedulerConfig(**config), kv_cache_manager, max_model_len)


def make_request(request_id: str, prompt: int | list[int], **params) -> Request:
    """A request with `prompt` tokens (unique to `request_id`: no accidental prefix hits)."""
    if isinstance(prompt, int):
        first_token_id = 1000 + zlib.crc32(request_id.encode()) % 1_000_000 * 1000
        prompt = list(range(first_token_id, first_token_id + prompt))
    prompt_token_ids = prompt
    params.setdefault("max_tokens", 4)
    return Request(request_id, prompt_token_ids, SamplingParams(**params), eos_token_ids=(EOS,))


def fake_sampled(output: SchedulerOutput, sampler: Sampler = fake_token) -> dict:
    """What a step's sampler would give: a token per sampling chunk, at each request's next
    output index (pending tokens are landed first, in launch order)."""
    return {
        chunk.request.request_id: (
            sampler(chunk.request.request_id, len(chunk.request.output_token_ids)),
            None,
        )
        for chunk in output.chunks
        if chunk.sample
    }


def step(
    scheduler: Scheduler, sampler: Sampler = fake_token
) -> tuple[SchedulerOutput, list[StepOutput]]:
    output = scheduler.schedule()
    scheduler.on_launched(output)
    return output, scheduler.update_from_output(output, fake_sampled(output, sampler))


def run_to_completion(
    scheduler: Scheduler, sampler: Sampler = fake_token, on_step=None
) -> dict[str, list[int]]:
    """Step until drained; every request's streamed tokens. Asserts nothing leaked."""
    tokens: dict[str, list[int]] = {}
    for _ in range(1000):
        if not scheduler.has_unfinished():
            break
        output, step_outputs = step(scheduler, sampler)
        if on_step is not None:
            on_step(output)
        for out in step_outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert not scheduler.has_unfinished()
    scheduler.kv_cache_manager.check_no_leaks()
    return tokens


def spans(output: SchedulerOutput) -> list[tuple[str, int, int, bool]]:
    return [(c.request.request_id, c.start_pos, c.num_new_tokens, c.sample) for c in output.chunks]


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


# ---- abort, prefill-only, decode role ----------------------------------------------------


def test_abort_from_every_queue_frees_blocks():
    scheduler = make_scheduler(prefill_only=True, max_num_batched_tokens=8)
    kv_cache_manager = scheduler.kv_cache_manager
    scheduler.add_request(make_request("held", 8))
    step(scheduler)
    scheduler.add_request(make_request("chunking", 12))
    step(scheduler)  # its first 8-token chunk
    scheduler.add_request(make_request("queued", 4))
    statuses = {r: scheduler.get_request(r).status for r in ("held", "chunking", "queued")}
    assert statuses == {
        "held": RequestStatus.PREFILLED,
        "chunking": RequestStatus.RUNNING,
        "queued": RequestStatus.WAITING,
    }
    assert kv_cache_manager.num_free_blocks == 64 - 4
    for request_id in statuses:
        request = scheduler.abort(request_id)
        assert request.status is RequestStatus.FINISHED_ABORTED
        assert request.block_ids == []
        assert scheduler.get_request(request_id) is None
    assert scheduler.abort("held") is None
    assert not scheduler.has_unfinished() and scheduler.num_prefilled_held == 0
    kv_cache_manager.check_no_leaks()


def test_abort_while_the_step_runs_drops_its_result():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 5))
    scheduler.add_request(make_request("b", 5))
    output = scheduler.schedule()
    scheduler.on_launched(output)
    scheduler.abort("a")
    step_outputs = scheduler.update_from_output(output, {"a": (7, None), "b": (8, None)})
    assert [o.request_id for o in step_outputs] == ["b"]
    run_to_completion(scheduler)


def test_prefill_only_holds_blocks_until_release():
    scheduler = make_scheduler(prefill_only=True)
    request = make_request("r", 10, max_tokens=5)
    scheduler.add_request(request)
    scheduler.add_request(make_request("one", 6, max_tokens=1))  # its first token finishes it
    _, step_outputs = step(scheduler)
    held, finished = step_outputs
    assert held.prefill_done and held.finish_reason is None
    assert held.new_token_ids == [fake_token("r", 0)]
    assert not finished.prefill_done and finished.finish_reason is FinishReason.LENGTH
    assert request.status is RequestStatus.PREFILLED and len(request.block_ids) == 3
    assert not scheduler.has_unfinished() and scheduler.num_prefilled_held == 1
    assert scheduler.schedule().is_empty
    with pytest.raises(AssertionError):
        scheduler.kv_cache_manager.check_no_leaks()
    assert scheduler.release("r") is request
    assert scheduler.release("r") is None
    scheduler.kv_cache_manager.check_no_leaks()


def test_release_refuses_a_request_still_prefilling():
    scheduler = make_scheduler(prefill_only=True)
    scheduler.add_request(make_request("r", 4))
    with pytest.raises(ValueError, match="use abort"):
        scheduler.release("r")
    scheduler.abort("r")
    scheduler.kv_cache_manager.check_no_leaks()


def prefilled_request(scheduler: Scheduler, request_id: str, first_token: int, **params):
    request = make_request(request_id, 9, **params)
    request.block_ids = scheduler.kv_cache_manager.reserve(request.prompt_len + 1)
    request.num_computed_tokens = request.prompt_len
    request.output_token_ids = [first_token]
    return request


def test_reserved_blocks_then_add_prefilled_decodes():
    scheduler = make_scheduler()
    request = prefilled_request(scheduler, "r", fake_token("r", 0))
    reserved = list(request.block_ids)
    scheduler.add_prefilled(request)
    output, (first_decode,) = step(scheduler)
    assert spans(output) == [("r", 9, 1, True)]
    assert output.chunks[0].token_ids == [fake_token("r", 0)]
    assert request.block_ids == reserved  # the reservation covers prompt + first token
    tokens = first_decode.new_token_ids + run_to_completion(scheduler)["r"]
    assert [fake_token("r", 0)] + tokens == [fake_token("r", i) for i in range(4)]
    # The transferred prompt's full blocks joined the prefix cache.
    probe = make_request("x", request.prompt_token_ids)
    assert scheduler.kv_cache_manager.get_computed_blocks(probe)[1] == 8


def test_add_prefilled_finished_by_its_first_token():
    scheduler = make_scheduler()
    scheduler.add_prefilled(prefilled_request(scheduler, "r", EOS))
    assert scheduler.has_unfinished()
    assert scheduler.schedule().is_empty
    (out,) = scheduler.drain_finished_outputs()
    assert (out.request_id, out.new_token_ids, out.finish_reason) == ("r", [], FinishReason.STOP)
    assert not scheduler.has_unfinished()
    scheduler.kv_cache_manager.check_no_leaks()


def test_add_prefilled_refuses_missing_kv():
    scheduler = make_scheduler()
    request = prefilled_request(scheduler, "r", 5)
    request.num_computed_tokens = 4
    with pytest.raises(ValueError, match="num_computed_tokens == num_tokens - 1"):
        scheduler.add_prefilled(request)
    scheduler.kv_cache_manager.free(request)
    scheduler.kv_cache_manager.check_no_leaks()


# ---- admission checks ------------------------------------------------------------------------


def test_admission_refuses_requests_that_could_never_run():
    scheduler = make_scheduler(num_blocks=4, max_model_len=32)
    scheduler.add_request(make_request("r", 4))
    with pytest.raises(InvalidRequestError, match="already in use"):
        scheduler.add_request(make_request("r", 4))
    with pytest.raises(InvalidRequestError, match="between 1 and max_model_len"):
        scheduler.add_request(make_request("long", 33))
    with pytest.raises(InvalidRequestError, match="between 1 and max_model_len"):
        scheduler.add_request(make_request("empty", []))
    with pytest.raises(InvalidRequestError, match="lower max_tokens or enlarge the cache"):
        scheduler.add_request(make_request("big", 10, max_tokens=8))  # 17 tokens of KV > 16
    used = make_request("used", 4)
    used.status = RequestStatus.FINISHED_STOPPED
    with pytest.raises(ValueError, match="must be new"):
        scheduler.add_request(used)
    run_to_completion(scheduler)
