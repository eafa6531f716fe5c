"""`Scheduler`: continuous batching under a token budget, with chunked prefill, prefix-cache
hits at admission and preemption by recompute.

    add_request ──> waiting (FCFS) ──admit──> running ──stop/length──> finished (blocks freed)
                      ^                        │   │
                      └── preempt (to front) ──┘   └─ prefill-only: first token ──> prefilled
    add_prefilled ───────────────────────────> running           release / abort ──> freed

One step schedules every running request first, in admission order (a decode, or the next
chunk of a chunked prefill), then admits waiting requests FCFS, until `max_num_batched_tokens`
or `max_num_seqs` runs out. A running request that cannot get a block preempts the most
recently admitted running request (possibly itself); a preempted request keeps its output
tokens and, when readmitted, recomputes the KV of prompt + output before sampling the next one.

A step's life: `schedule()` -> the caller launches it -> `on_launched` (its requests' KV counts
as computed, each sampled token as pending) -> `update_from_output` once its tokens are on the
host (in launch order). Async scheduling (`schedule_ahead`): while step n runs on the device,
step n+1 is chosen the same way before n's tokens are known, each such token `PENDING` in its
decode (read on the device), without preemption (None instead). A request that stops at step n
wastes its step n+1 slot (the result is dropped), and its blocks are freed only once no
launched step writes them (`InFlightSteps`). Speculative decoding (`spec`, engine/spec_decode):
a decode also gets draft slots, its verify chunk lands its accepted run, rolled back past it.

With chunked prefill disabled, a prompt waits until it fits the step's remaining budget whole;
`max_num_batched_tokens >= max_model_len` is then required (checked at construction), so that
every request, including a preempted one recomputing its output, fits an empty step.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Mapping, Sequence

from engine.in_flight_steps import InFlightSteps
from engine.kv_cache_manager import KVCacheManager
from engine.outputs import StepOutput
from engine.request import Request, RequestStatus, TokenLogprobs
from engine.request_checks import (
    check_admissible,
    check_prefilled,
    check_scheduler_config,
    stop_status,
)
from engine.scheduler_output import SchedulerOutput, next_chunk
from engine.spec_decode.landing import land_verified
from engine.spec_decode.spec_decoder import SpecDecoder
from pdserve.config import SchedulerConfig

logger = logging.getLogger(__name__)
SampledTokens = Mapping[str, tuple[int, TokenLogprobs | None]]  # request_id -> (token, logprobs)
VerifiedTokens = Mapping[str, Sequence[tuple[int, TokenLogprobs | None]]]  # one per position


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        max_model_len: int,
        spec: SpecDecoder | None = None,  # speculative decoding: draft slots, verify landing
    ) -> None:
        check_scheduler_config(config, max_model_len)
        self.config = config
        self.spec = spec
        self.kv_cache_manager = kv_cache_manager
        self.max_model_len = max_model_len
        self.num_preemptions = 0  # total since construction
        self.num_prompt_tokens_computed = 0  # prompt tokens run through the model, in total
        self._requests: dict[str, Request] = {}  # every request not finished or released
        self._waiting: deque[Request] = deque()
        self._running: dict[str, Request] = {}  # in admission order: the last is preempted first
        self._prefilled: dict[str, Request] = {}  # prefill-only: blocks held until release()
        self._pending_outputs: list[StepOutput] = []  # finished outside a step
        self._in_flight = InFlightSteps(kv_cache_manager)  # frees wait for the steps writing

    # ---- queues ---------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_prefilled_held(self) -> int:
        return len(self._prefilled)

    def has_unfinished(self) -> bool:
        """True while a step has work or outputs to report (held PREFILLED requests need none)."""
        return bool(self._waiting or self._running or self._pending_outputs)

    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def add_request(self, request: Request) -> None:
        """Queue a fresh request; it prefills from scratch or from a prefix-cache hit."""
        if request.status is not RequestStatus.WAITING or request.block_ids:
            raise ValueError(
                f"request {request.request_id!r} must be new (WAITING, no blocks), "
                f"got status {request.status.name} with {len(request.block_ids)} blocks"
            )
        check_admissible(request, self._requests, self.max_model_len, self.kv_cache_manager)
        self._requests[request.request_id] = request
        self._waiting.append(request)

    def add_prefilled(self, request: Request) -> None:
        """Admit a request whose prompt KV already sits in `request.block_ids`, every token but
        its last (the first sampled one) computed. If that token already finishes it, it
        finishes at once; its StepOutput (no new tokens) comes with the next step's outputs."""
        check_prefilled(request, self.kv_cache_manager.block_size)
        check_admissible(request, self._requests, self.max_model_len, self.kv_cache_manager)
        self._requests[request.request_id] = request
        self.kv_cache_manager.cache_full_blocks(request)
        status = stop_status(request, self.max_model_len)
        if status is not None:
            self._finish(request, status)
            self._pending_outputs.append(StepOutput.of_request(request, None))
            return
        request.status = RequestStatus.RUNNING
        self._running[request.request_id] = request

    def abort(self, request_id: str) -> Request | None:
        """Stop a request wherever it is and free its blocks; None if it is unknown."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return None
        if request.status is RequestStatus.RUNNING:
            del self._running[request_id]
        elif request.status is RequestStatus.PREFILLED:
            del self._prefilled[request_id]
        else:
            self._waiting.remove(request)
        self._in_flight.free(request)
        request.status = RequestStatus.FINISHED_ABORTED
        return request

    def release(self, request_id: str) -> Request | None:
        """Prefill-only: free a PREFILLED request's held blocks; None if it is unknown."""
        request = self._prefilled.pop(request_id, None)
        if request is None:
            if request_id in self._requests:
                raise ValueError(
                    f"request {request_id!r} is {self._requests[request_id].status.name}, not "
                    "PREFILLED: release() follows a finished prefill; use abort() to stop it"
                )
            return None
        del self._requests[request_id]
        self._in_flight.free(request)
        return request

    def drain_finished_outputs(self) -> list[StepOutput]:
        """Outputs of requests that finished outside a step (see `add_prefilled`)."""
        outputs, self._pending_outputs = self._pending_outputs, []
        return outputs

    # ---- one step -------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Choose this step's chunks: running requests first, then waiting ones FCFS."""
        output = SchedulerOutput()
        budget = self._schedule_running(output, preempt=True)  # (an int when it may preempt)
        # After a preemption the pool is short: admitting more would only preempt again.
        if budget is not None and not output.preempted_request_ids:
            self._schedule_waiting(output, budget)
        return output

    def schedule_ahead(self) -> SchedulerOutput | None:
        """Step n+1 while step n runs (async scheduling), or None when it must wait for n's
        tokens and run `schedule()` then. Chosen as `schedule()` would, with the token step n
        samples for a request as `PENDING` (its decode's input, read on the device), except
        that None replaces any preemption (a launched step may still write the victim's KV)."""
        if self.config.prefill_only or (self.spec and self.spec.any_speculates(self._running)):
            return None  # (a verify step's inputs depend on how many drafts were accepted)
        output = SchedulerOutput()
        budget = self._schedule_running(output, preempt=False)
        if budget is None:
            return None  # (the slots taken so far serve the next schedule() as well)
        self._schedule_waiting(output, budget)
        return output if output.chunks else None

    def on_launched(self, scheduler_output: SchedulerOutput, sampled: bool = True) -> None:
        """The step is queued on the device: its requests' KV positions count as computed and
        each sampling chunk's token as pending, so the next step can be scheduled before the
        tokens are on the host (`schedule_ahead`). `sampled=False`: its sampling waits (a
        grammar mask needs the previous step's tokens); `on_sampled` once it is queued."""
        for chunk in scheduler_output.chunks:
            request = chunk.request
            request.num_computed_tokens = chunk.end_pos
            # prompt tokens run through the model (a prefix-cache hit is not; a recompute is)
            self.num_prompt_tokens_computed += max(
                0, min(chunk.end_pos, request.prompt_len) - chunk.start_pos
            )
        if sampled:
            self.on_sampled(scheduler_output)
        self._in_flight.launched(scheduler_output)

    def on_sampled(self, scheduler_output: SchedulerOutput) -> None:
        """The step's sampling is queued: each sampling chunk's token is pending."""
        for chunk in scheduler_output.chunks:
            if chunk.sample:
                chunk.request.num_pending_tokens += 1

    def update_from_output(
        self,
        scheduler_output: SchedulerOutput,
        sampled: SampledTokens,
        verified: VerifiedTokens | None = None,
    ) -> list[StepOutput]:
        """The oldest launched step's results (`on_launched` first): append its sampled tokens,
        cache the blocks it filled, apply stop checks. `sampled` holds one (token, logprobs)
        per chunk with `sample=True`; `verified` those of each verify chunk's positions."""
        self._in_flight.land(scheduler_output)
        outputs = self.drain_finished_outputs()
        for chunk in scheduler_output.chunks:
            request = chunk.request
            if request.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran, or stopped by the step before it
            if chunk.num_draft_tokens:  # a verify chunk: its accepted run, its rollback
                assert self.spec is not None and verified is not None
                request.num_pending_tokens -= 1
                emitted, status = land_verified(
                    self.spec, chunk, verified[request.request_id], self.kv_cache_manager,
                    self.max_model_len,
                )  # fmt: skip
                if status is not None:
                    self._finish(request, status)
                outputs.append(StepOutput.of_tokens(request, emitted))
                continue
            self.kv_cache_manager.cache_full_blocks(request, chunk.end_pos)
            if chunk.sample:
                token_id, logprobs = sampled[request.request_id]
                request.num_pending_tokens -= 1
                outputs.append(self._append_token(request, token_id, logprobs))
        self._in_flight.free_deferred()
        return outputs

    def _schedule_running(self, output: SchedulerOutput, preempt: bool) -> int | None:
        """Chunks for the running requests, in admission order; the budget left. A request
        whose pending token ends it for certain (on length) is left out. Without `preempt`,
        None when a request's slots cannot be had."""
        budget = self.config.max_num_batched_tokens
        for request in list(self._running.values()):
            if budget == 0 or len(output.chunks) == self.config.max_num_seqs:
                break
            if request.status is not RequestStatus.RUNNING:
                break  # preempted (from the back) to make room for an earlier request
            pending = request.num_pending_tokens
            if pending and (
                request.num_sampled_tokens >= request.sampling_params.max_tokens
                or request.num_tokens + pending >= self.max_model_len
            ):
                continue  # stops at the running step
            num_new_tokens = min(request.num_tokens + pending - request.num_computed_tokens, budget)
            lookahead = self._draft_slots(request, num_new_tokens, budget)  # allocated; 0: none
            if not lookahead and not preempt:
                if not self.kv_cache_manager.allocate_slots(request, num_new_tokens):
                    return None
            elif not lookahead and not self._allocate_or_preempt(request, num_new_tokens, output):
                break
            output.chunks.append(next_chunk(request, num_new_tokens, lookahead))
            budget -= num_new_tokens + lookahead
        return budget

    def _draft_slots(self, request: Request, num_new_tokens: int, budget: int) -> int:
        """Speculative decoding: draft slots allocated with a decode (never by preemption)."""
        if self.spec is None:
            return 0
        return self.spec.allocate_draft_slots(
            request, num_new_tokens, budget, self.kv_cache_manager, self.max_model_len
        )

    def _allocate_or_preempt(
        self, request: Request, num_new_tokens: int, output: SchedulerOutput
    ) -> bool:
        """Blocks for `request`'s next tokens, preempting from the back of the running queue
        until they fit. False when `request` itself had to be preempted."""
        while not self.kv_cache_manager.allocate_slots(request, num_new_tokens):
            _, victim = self._running.popitem()
            self._preempt(victim)
            output.preempted_request_ids.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _schedule_waiting(self, output: SchedulerOutput, budget: int) -> None:
        kv_cache_manager = self.kv_cache_manager
        while self._waiting and budget > 0 and len(self._running) < self.config.max_num_seqs:
            request = self._waiting[0]
            computed_block_ids, num_hit_tokens = (
                ([], 0)  # its prompt logprobs need every prompt position computed
                if request.wants_prompt_logprobs
                else kv_cache_manager.get_computed_blocks(request)
            )
            num_new_tokens = request.num_tokens - num_hit_tokens
            if num_new_tokens > budget:
                if not self.config.enable_chunked_prefill:
                    break
                num_new_tokens = budget
            if not kv_cache_manager.allocate_slots(request, num_new_tokens, computed_block_ids):
                break
            self._waiting.popleft()
            request.num_computed_tokens = num_hit_tokens
            if request.status is RequestStatus.WAITING:  # first admission, not a readmission
                request.num_cached_tokens = num_hit_tokens
            request.status = RequestStatus.RUNNING
            self._running[request.request_id] = request
            output.chunks.append(next_chunk(request, num_new_tokens))
            budget -= num_new_tokens

    # ---- request transitions --------------------------------------------------------------

    def _preempt(self, request: Request) -> None:
        self._in_flight.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._waiting.appendleft(request)

    def _append_token(
        self, request: Request, token_id: int, logprobs: TokenLogprobs | None
    ) -> StepOutput:
        request.output_token_ids.append(token_id)
        if logprobs is not None:
            request.output_logprobs.append(logprobs)
        if request.matcher is not None and not request.matcher.accept_token(token_id):
            logger.warning(
                "request %r: its grammar refused token %d (%s); the request is aborted",
                request.request_id, token_id, request.matcher.error,
            )  # fmt: skip
        status = stop_status(request, self.max_model_len)
        prefill_done = False
        if status is not None:
            self._finish(request, status)
        elif self.config.prefill_only:
            request.status = RequestStatus.PREFILLED
            del self._running[request.request_id]
            self._prefilled[request.request_id] = request
            prefill_done = True
        return StepOutput.of_request(request, token_id, logprobs, prefill_done)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self._running.pop(request.request_id, None)
        del self._requests[request.request_id]
        self._in_flight.free(request)
