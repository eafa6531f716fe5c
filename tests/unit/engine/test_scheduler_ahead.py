"""Scheduler.schedule_ahead (async scheduling) driven by a fake sampler, no model: decodes of
tokens still pending on the device, requests stopping on length left out, penalties going
ahead too, no preemption while a step is in flight."""

from __future__ import annotations

from engine.outputs import StepOutput
from engine.request import FinishReason
from engine.scheduler import Scheduler
from engine.scheduler_output import PENDING, SchedulerOutput
from tests.unit.engine.scheduler_harness import (
    fake_sampled,
    fake_token,
    make_request,
    make_scheduler,
)


def launch(scheduler: Scheduler, output: SchedulerOutput) -> SchedulerOutput:
    scheduler.on_launched(output)
    return output


def land(scheduler: Scheduler, output: SchedulerOutput) -> list[StepOutput]:
    """The launched step's results, sampled by fake_token at each request's output index."""
    return scheduler.update_from_output(output, fake_sampled(output))


def test_schedule_ahead_decodes_pending_tokens_and_leaves_out_length_stops() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 6, max_tokens=2))
    scheduler.add_request(make_request("b", 6, max_tokens=5))
    first = launch(scheduler, scheduler.schedule())  # both prompts; each samples its 1st token
    ahead = launch(scheduler, scheduler.schedule_ahead())
    # "a" stops on length at its 2nd token, which the ahead step's decode would be: still in
    assert [(c.request.request_id, c.token_ids, c.start_pos) for c in ahead.chunks] == [
        ("a", [PENDING], 6), ("b", [PENDING], 6),
    ]  # fmt: skip
    land(scheduler, first)
    third = scheduler.schedule_ahead()  # "a" samples its last token in `ahead`: left out
    assert [c.request.request_id for c in third.chunks] == ["b"]
    launch(scheduler, third)
    outputs = land(scheduler, ahead)
    assert {o.request_id: o.finish_reason for o in outputs}["a"] == FinishReason.LENGTH
    land(scheduler, third)
    assert scheduler.get_request("b").output_token_ids == [fake_token("b", i) for i in range(3)]


def test_schedule_ahead_decodes_requests_with_penalties_too() -> None:
    """Penalties read the output so far; its pending token is counted on the device (the
    model runner hands the sampler the previous step's ids), so the request goes ahead."""
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 6, max_tokens=8, presence_penalty=0.5))
    launch(scheduler, scheduler.schedule())
    ahead = scheduler.schedule_ahead()
    assert [c.token_ids for c in ahead.chunks] == [[PENDING]]


def test_schedule_ahead_never_preempts() -> None:
    """Two requests fill the pool; the next decode needs a new block: ahead gives up (the
    running step may still write the victim's KV) and schedule() preempts once it landed."""
    scheduler = make_scheduler(num_blocks=4)
    scheduler.add_request(make_request("a", 8, max_tokens=8))
    scheduler.add_request(make_request("b", 8, max_tokens=8))
    first = launch(scheduler, scheduler.schedule())  # 2 blocks each: the pool is full
    free_before = scheduler.kv_cache_manager.num_free_blocks
    assert scheduler.schedule_ahead() is None
    assert scheduler.num_preemptions == 0
    assert scheduler.kv_cache_manager.num_free_blocks == free_before
    land(scheduler, first)
    output = scheduler.schedule()
    assert output.preempted_request_ids == ["b"]
