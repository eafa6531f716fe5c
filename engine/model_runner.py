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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.cuda_graphs import DecodeGraphs
from engine.request import Request, TokenLogprobs
from engine.sampler import Sampler
from engine.sampler_output import PendingSample
from engine.scheduler_output import DeviceTokens, ScheduledChunk, SchedulerOutput
from engine.spec_decode.verification import sampling_rows
from engine.step_inputs import FlatBatch, StepInputBuilder, verify_query_len

if TYPE_CHECKING:
    from engine.model.llama import LlamaForCausalLM

# Called after layer `layer_idx` wrote its KV, with the prefill chunks of the step. On CUDA the
# write is queued, not done: `ModelRunner.layer_ready(layer_idx)` is the event to wait on.
LayerHook = Callable[[int, Sequence[ScheduledChunk]], None]


@dataclass
class ModelRunnerOutput:
    # request_id -> (sampled token, its logprobs if asked); only chunks with sample=True
    sampled: dict[str, tuple[int, TokenLogprobs | None]] = field(default_factory=dict)
    # request_id -> a verify chunk's (token, logprobs) at each of its positions, in order
    verified: dict[str, list[tuple[int, TokenLogprobs | None]]] = field(default_factory=dict)


@dataclass
class LaunchedStep:
    """A step queued on the device: its sampled ids on the device, their copy under way."""

    sampling_requests: list[Request] = field(default_factory=list)  # in sampled-row order
    sample: PendingSample | None = None
    # requests whose rows are a verify chunk's positions (several rows each; never read as a
    # PENDING token's source: a speculating request's next step waits for this one)
    verifying: frozenset[Request] = frozenset()

    def device_tokens(self) -> DeviceTokens | None:
        """Where the next step finds each request's token while this one runs."""
        if self.sample is None:
            return None
        rows = {request: i for i, request in enumerate(self.sampling_requests)}
        return DeviceTokens(self.sample.token_ids, rows)

    def wait(self) -> ModelRunnerOutput:
        """The sampled tokens on the host (waits for the device, GIL released)."""
        output = ModelRunnerOutput()
        if self.sample is None:
            return output
        sampled = self.sample.result()
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
    ) -> LaunchedStep:
        """Queue one step: `prepare` (inputs; `PENDING` decodes read `prev`'s ids), `forward`
        (graph replay or eager), the sampler, and the copy of its ids. No wait."""
        prev_tokens = prev.device_tokens() if prev else None
        batch = self._build(scheduler_output.chunks, prev_tokens)
        hidden = self.forward(batch, on_layer_done)
        return self.sample_async(batch, hidden, prev_tokens)

    def prepare(self, scheduler_output: SchedulerOutput) -> FlatBatch:
        """The step's device inputs (host numpy, one copy); no sync."""
        return self._build(scheduler_output.chunks)

    @torch.inference_mode()
    def forward(self, batch: FlatBatch, on_layer_done: LayerHook | None = None) -> torch.Tensor:
        """Hidden states [rows, hidden]: a graph replay for a graph-routed decode batch, else
        one eager model call (with the per-layer hook for prefill chunks). Queued, not waited."""
        if self.on_batch is not None:
            self.on_batch(batch)
        graphs = self.decode_graphs if batch.meta.decode_query_len == 1 else self.verify_graphs
        if batch.is_decode_only and graphs is not None:
            return graphs.run(batch)
        return self.model(
            batch.input_ids, batch.positions, self.kv_caches, batch.meta,
            self._layer_hook(batch, on_layer_done),
        )  # fmt: skip

    def sample(self, batch: FlatBatch, hidden: torch.Tensor) -> ModelRunnerOutput:
        """`sample_async` and wait: the step's only sync."""
        return self.sample_async(batch, hidden).wait()

    @torch.inference_mode()
    def sample_async(
        self, batch: FlatBatch, hidden: torch.Tensor, prev: DeviceTokens | None = None
    ) -> LaunchedStep:
        """Logits of the sampling rows, the sampler on the device for the whole batch, and the
        queued copy of the sampled ids (with any logprobs) to the host. `prev`: where the
        tokens still pending on the device are (penalties count them)."""
        step = LaunchedStep()
        if not batch.sampling_chunks:
            return step
        if batch.is_decode_only and len(batch.sampling_chunks) == len(batch.chunks):
            rows = hidden[: len(batch.chunks) * batch.meta.decode_query_len]  # no gather needed
        else:
            rows = hidden[batch.logits_indices]
        logits = self.model.compute_logits(rows)  # [num_sampled_rows, vocab]
        chunks = batch.sampling_chunks
        step.sampling_requests = [c.request for c in chunks for _ in range(c.num_sampled_rows)]
        step.verifying = frozenset(c.request for c in chunks if c.num_draft_tokens)
        step.sample = self.sampler.launch(logits, sampling_rows(chunks), prev)
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
        return self.inputs.build(chunks, pad_to, prev)

    def _layer_hook(
        self, batch: FlatBatch, on_layer_done: LayerHook | None
    ) -> Callable[[int], None] | None:
        prefill_chunks = [c for c in batch.chunks if c.is_prefill]
        if on_layer_done is None or not prefill_chunks:
            return None
        events = self._layer_events

        def layer_hook(layer_idx: int) -> None:
            if events:
                events[layer_idx].record()  # no sync: consumers wait on layer_ready()
            on_layer_done(layer_idx, prefill_chunks)

        return layer_hook
