"""A `Scheduler` driven by a fake sampler, no model: the helpers of the scheduler tests."""

from __future__ import annotations

import zlib
from collections.abc import Callable

from engine.kv_cache_manager import KVCacheManager
from engine.outputs import StepOutput
from engine.request import Request
from engine.scheduler import Scheduler
from engine.scheduler_output import SchedulerOutput
from pdserve.config import SchedulerConfig
from pdserve.sampling_params import SamplingParams

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


def prefilled_request(scheduler: Scheduler, request_id: str, first_token: int, **params):
    request = make_request(request_id, 9, **params)
    request.block_ids = scheduler.kv_cache_manager.reserve(request.prompt_len + 1)
    request.num_computed_tokens = request.prompt_len
    request.output_token_ids = [first_token]
    return request
