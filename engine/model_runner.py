"""Turns a `SchedulerOutput` into one forward pass over a flat varlen batch, then samples.

SchedulerOutput.chunks (any order)
  -> StepInputBuilder: decodes first; numpy -> one host buffer -> one copy to the device
     (engine/step_inputs.py); a decode-only batch pads to a CUDA graph's batch size
  -> decode-only and graphs ready: DecodeGraphs.run (replay; engine/cuda_graphs.py)
     otherwise: model.forward (one call, eager), recording a CUDA event per layer for the
     prefill hook
  -> logits of each chunk that samples (its last token) -> Sampler -> ModelRunnerOutput
     (on the device for the whole batch; one copy brings the ids back: the step's only sync)

execute() = launch().wait(); launch() = prepare() -> forward() -> sample on the device and
queue the copy of the ids (no wait), so the caller can schedule and launch the next step
before this one's tokens are on the host (async scheduling, `EngineCore.step`); the next
step's `PENDING` decodes read their input from this step's ids on the device. The phases are
public so that benchmarks/engine/profile_step.py can time each one.

Structured outputs: the sampler applies the grammar mask of the constrained rows
(`TokenBitmask`, engine/structured/), built from their matchers just before sampling. A step
launched ahead of the previous one's tokens (`launch(defer_sampling=True)`) queues its forward
only; `sample_deferred` samples it once the tokens it waited for advanced the matchers.
Prompt logprobs (engine/prompt_logprobs.py) are queued after the forward, copied beside the ids.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.cuda_graphs import DecodeGraphs
from engine.distributed import TensorParallel
from engine.distributed.step_message import StepMessage
from engine.outputs import PrefillLayerChunk
from engine.prompt_logprobs import (
    PendingPromptLogprobs,
    PromptLogprobResults,
    launch_prompt_logprobs,
)
from engine.request import Request, TokenLogprobs
from engine.sampler import Sampler
from engine.sampler_output import PendingSample
from engine.scheduler_output import DeviceTokens, ScheduledChunk, SchedulerOutput
from engine.spec_decode.verification import sampling_rows
from engine.step_inputs import FlatBatch, HostStep, StepInputBuilder, verify_query_len
from engine.structured import TokenBitmask

if TYPE_CHECKING:
    from engine.model.llama import LlamaForCausalLM

# Called after layer `layer_idx` wrote its KV, with the step's prefill chunks (snapshots, the
# same tuple for every layer of a step). On CUDA the write is queued, not done:
# `ModelRunner.layer_ready(layer_idx)` is the event to wait on.
LayerHook = Callable[[int, tuple[PrefillLayerChunk, ...]], None]


@dataclass
class ModelRunnerOutput:
    # request_id -> (sampled token, its logprobs if asked); only chunks with sample=True
    sampled: dict[str, tuple[int, TokenLogprobs | None]] = field(default_factory=dict)
    # request_id -> a verify chunk's (token, logprobs) at each of its positions, in order
    verified: dict[str, list[tuple[int, TokenLogprobs | None]]] = field(default_factory=dict)
    # request_id -> (first prompt position, its prompt logprobs from there), if it asked
    prompt_logprobs: PromptLogprobResults = field(default_factory=dict)


@dataclass
class LaunchedStep:
    """A step queued on the device: its sampled ids on the device, their copy under way."""

    sampling_requests: list[Request] = field(default_factory=list)  # in sampled-row order
    sample: PendingSample | None = None
    # requests whose rows are a verify chunk's positions (several rows each; never read as a
    # PENDING token's source: a speculating request's next step waits for this one)
    verifying: frozenset[Request] = frozenset()
    # launched with defer_sampling: the forward's batch and hidden states, until sampled
    deferred: tuple[FlatBatch, torch.Tensor] | None = None
    prompt_logprobs: PendingPromptLogprobs | None = None
    check: Callable[[], None] | None = None  # tensor parallelism: raises if a rank failed

    def device_tokens(self) -> DeviceTokens | None:
        """Where the next step finds each request's token while this one runs."""
        if self.deferred is not None:
            raise RuntimeError("the step's sampling was deferred: sample_deferred it first")
        if self.sample is None:
            return None
        rows = {request: i for i, request in enumerate(self.sampling_requests)}
        return DeviceTokens(self.sample.token_ids, rows)

    def wait(self) -> ModelRunnerOutput:
        """The sampled tokens on the host (waits for the device, GIL released)."""
        output = ModelRunnerOutput()
        if self.deferred is not None:
            raise RuntimeError("the step's sampling was deferred: sample_deferred it first")
        if self.prompt_logprobs is not None:
            output.prompt_logprobs = self.prompt_logprobs.result()
        if self.sample is None:
            return output
        sampled = self.sample.result()
        if self.check is not None:
            self.check()  # no tokens from a step a rank died in
        for request, token_id, logprobs in zip(
            self.sampling_requests, sampled.token_ids, sampled.logprobs
        ):
            if request in self.verifying:
                output.verified.setdefault(request.request_id, []).append((token_id, logprobs))
            else:
                output.sampled[request.request_id] = (token_id, logprobs)
        return output


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        sampler: Sampler,
        device: torch.device,
        scratch_block: int = 0,
        decode_graphs: DecodeGraphs | None = None,
        verify_graphs: DecodeGraphs | None = None,
        on_batch: Callable[[FlatBatch], None] | None = None,
    ) -> None:
        """`scratch_block`: a KV block never handed out, where padded rows write;
        `decode_graphs`: static decode buffers (and graphs, once captured) on CUDA;
        `verify_graphs`: the same for speculative verify steps (K + 1 tokens per request);
        `on_batch`: called with every step's inputs before its forward (a draft model)."""
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.sampler = sampler
        self.device = device
        self.inputs = StepInputBuilder(block_size, scratch_block, device)
        self.decode_graphs = decode_graphs
        self.verify_graphs = verify_graphs
        self.on_batch = on_batch
        self.token_bitmask: TokenBitmask | None = None  # set when structured outputs can run
        # Rank 0 of a tensor-parallel group (EngineCore sets it): each step's inputs go to the
        # other ranks, which run the same forward (`follow`)
        self.tp: TensorParallel | None = None
        self._layer_events: list[torch.cuda.Event] = []
        if device.type == "cuda":
            self._layer_events = [torch.cuda.Event() for _ in kv_caches]

    def layer_ready(self, layer_idx: int) -> torch.cuda.Event | None:
        """The CUDA event recorded once layer `layer_idx`'s KV write of the current prefill
        step is queued: `event.synchronize()` (or `stream.wait_event(event)`) before reading
        that layer's KV. None on CPU, where the hook runs after the write has happened."""
        return self._layer_events[layer_idx] if self._layer_events else None

    def execute(
        self, scheduler_output: SchedulerOutput, on_layer_done: LayerHook | None = None
    ) -> ModelRunnerOutput:
        """One step, waited for: `launch(...).wait()`."""
        return self.launch(scheduler_output, on_layer_done).wait()

    def launch(
        self,
        scheduler_output: SchedulerOutput,
        on_layer_done: LayerHook | None = None,
        prev: LaunchedStep | None = None,
        defer_sampling: bool = False,
    ) -> LaunchedStep:
        """Queue one step: `prepare` (inputs; `PENDING` decodes read `prev`'s ids), `forward`
        (graph replay or eager), the sampler, and the copy of its ids. No wait. With
        `defer_sampling`, the forward only: `sample_deferred` samples it (once `prev`'s tokens
        are on the host and every token before this step's has been accepted)."""
        prev_tokens = prev.device_tokens() if prev else None
        batch = self._build(scheduler_output.chunks, prev_tokens)
        hidden = self.forward(batch, on_layer_done)
        prompt_logprobs = launch_prompt_logprobs(self.model, batch, hidden)
        if defer_sampling:
            step = LaunchedStep(deferred=(batch, hidden))
        else:
            step = self.sample_async(batch, hidden, prev_tokens)
        step.prompt_logprobs = prompt_logprobs
        return step

    def sample_deferred(self, step: LaunchedStep) -> None:
        """Sample a step launched with `defer_sampling`: every token of the requests before
        this step's is on the host now (no pending token for penalties to find)."""
        if step.deferred is None:
            raise RuntimeError("the step was sampled at launch")
        (batch, hidden), step.deferred = step.deferred, None
        sampled = self.sample_async(batch, hidden)
        step.sampling_requests, step.sample = sampled.sampling_requests, sampled.sample
        step.check, step.verifying = sampled.check, sampled.verifying

    def prepare(self, scheduler_output: SchedulerOutput) -> FlatBatch:
        """The step's device inputs (host numpy, one copy); no sync."""
        return self._build(scheduler_output.chunks)

    @torch.inference_mode()
    def forward(
        self,
        batch: FlatBatch,
        on_layer_done: LayerHook | None = None,
        prefill_chunks: tuple[PrefillLayerChunk, ...] | None = None,
    ) -> torch.Tensor:
        """Hidden states [rows, hidden]: a graph replay for a graph-routed decode batch, else
        one eager model call (with the per-layer hook for prefill chunks: the batch's, or
        `prefill_chunks` on a tensor-parallel worker rank). Queued, not waited."""
        if self.on_batch is not None:
            self.on_batch(batch)
        graphs = self.decode_graphs if batch.meta.decode_query_len == 1 else self.verify_graphs
        if batch.is_decode_only and graphs is not None:
            return graphs.run(batch)
        if prefill_chunks is None and on_layer_done is not None:
            prefill_chunks = _prefill_chunks(batch)
        return self.model(
            batch.input_ids, batch.positions, self.kv_caches, batch.meta,
            self._layer_hook(prefill_chunks or (), on_layer_done),
        )  # fmt: skip

    @torch.inference_mode()
    def follow(
        self, message: StepMessage, tp: TensorParallel, on_layer_done: LayerHook | None
    ) -> None:
        """A tensor-parallel worker rank's step: rank 0's inputs (`_publish`), the same
        forward (its collectives with rank 0's), this rank's vocab slice of the logits to rank 0."""
        width, decode_only, num_prev, query_len = message.ints
        prev_ids = tp.receive_tokens(num_prev) if num_prev else None
        step = HostStep(message.arrays, width, bool(decode_only), query_len)
        batch = self.inputs.from_host(step, prev_ids)
        hidden = self.forward(batch, on_layer_done, message.extras or ())
        if batch.logits_indices.numel():
            self.model.compute_logits(hidden[batch.logits_indices])

    def sample(self, batch: FlatBatch, hidden: torch.Tensor) -> ModelRunnerOutput:
        """`sample_async` and wait: the step's only sync."""
        return self.sample_async(batch, hidden).wait()

    @torch.inference_mode()
    def sample_async(
        self, batch: FlatBatch, hidden: torch.Tensor, prev: DeviceTokens | None = None
    ) -> LaunchedStep:
        """Logits of the sampling rows, the sampler on the device for the whole batch, and the
        queued copy of the sampled ids (with any logprobs) to the host. `prev`: where the
        tokens still pending on the device are (penalties count them). Constrained requests'
        grammar masks are built here, from their matchers as they stand."""
        step = LaunchedStep(check=self.tp.check if self.tp is not None else None)
        if not batch.sampling_chunks:
            return step
        chunks = batch.sampling_chunks
        step.sampling_requests = [c.request for c in chunks for _ in range(c.num_sampled_rows)]
        step.verifying = frozenset(c.request for c in chunks if c.num_draft_tokens)
        row_views = sampling_rows(chunks)  # a verify chunk's request: one view per position
        mask = None
        if self.token_bitmask is not None:  # host work first: the device runs the forward
            mask = self.token_bitmask.build([r.matcher for r in row_views])
        if batch.is_decode_only and len(batch.sampling_chunks) == len(batch.chunks):
            rows = hidden[: len(batch.chunks) * batch.meta.decode_query_len]  # no gather needed
        else:
            rows = hidden[batch.logits_indices]
        logits = self.model.compute_logits(rows)  # [num_sampled_rows, vocab]
        step.sample = self.sampler.launch(logits, row_views, prev, mask)
        return step

    def _build(
        self, chunks: Sequence[ScheduledChunk], prev: DeviceTokens | None = None
    ) -> FlatBatch:
        """The step's inputs, padded (and `is_decode_only`: graph-routed) only for a batch of
        plain decodes (no 1-token prompt chunk, whose KV the prefill hook must see) that fits
        a graph."""
        pad_to = None
        if self.decode_graphs is not None and all(
            c.num_new_tokens == 1 and not c.is_prefill for c in chunks
        ):
            pad_to = self.decode_graphs.padded_size(len(chunks))
        elif self.verify_graphs is not None and (
            verify_query_len(chunks) == self.verify_graphs.query_len
        ):  # a verify step whose every request verifies K drafts
            pad_to = self.verify_graphs.padded_size(len(chunks))
        batch = self.inputs.build(chunks, pad_to, prev)
        if self.tp is not None:
            self._publish(batch, prev)
        return batch

    def _publish(self, batch: FlatBatch, prev: DeviceTokens | None) -> None:
        """(rank 0 of a tensor-parallel group) Hand the step's host inputs to the other ranks,
        with the previous step's ids on the device when `PENDING` decodes read them, and the
        prefill chunks their layer hooks get (when they have one)."""
        assert self.tp is not None
        host = batch.host
        prev_ids = prev.token_ids if prev is not None and host.num_pending else None
        chunks = _prefill_chunks(batch) if self.tp.worker_hooks else None
        num_prev = 0 if prev_ids is None else prev_ids.numel()
        ints = (host.block_table_width, int(host.is_decode_only), num_prev, host.decode_query_len)
        self.tp.send_step(StepMessage(ints, host.fields, chunks or None), prev_ids)

    def _layer_hook(
        self, prefill_chunks: tuple[PrefillLayerChunk, ...], on_layer_done: LayerHook | None
    ) -> Callable[[int], None] | None:
        if on_layer_done is None or not prefill_chunks:
            return None
        events = self._layer_events

        def layer_hook(layer_idx: int) -> None:
            if events:
                events[layer_idx].record()  # no sync: consumers wait on layer_ready()
            on_layer_done(layer_idx, prefill_chunks)

        return layer_hook


def _prefill_chunks(batch: FlatBatch) -> tuple[PrefillLayerChunk, ...]:
    """What a prefill layer hook gets for `batch`: its prefill chunks, as snapshots (built once
    per step, the same tuple for every layer's call, and shipped to the other ranks)."""
    return tuple(
        PrefillLayerChunk(
            c.request.request_id, c.start_pos, c.num_new_tokens, c.request.prompt_len,
            tuple(c.block_ids),
        )
        for c in batch.chunks
        if c.is_prefill
    )  # fmt: skip
