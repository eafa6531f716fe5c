"""Scheduler driven by a fake sampler (no model): abort from every queue, the prefill-only
hold until release, the decode role (add_prefilled) and the refusal of requests that could
never run."""

from __future__ import annotations

import pytest

from engine.request import FinishReason, RequestStatus
from pdserve.sampling_params import InvalidRequestError
from tests.unit.engine.scheduler_harness import (
    EOS,
    fake_token,
    make_request,
    make_scheduler,
    prefilled_request,
    run_to_completion,
    spans,
    step,
)

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
