"""Turns a `SchedulerOutput` into one forward pass over a flat varlen batch, then samples.

    SchedulerOutput.chunks (any order)
      -> order decodes first (query length 1), as the attention backends expect
      -> input_ids [T], positions [T], AttentionMetadata (cu_seqlens, seq_lens, slot_mapping,
         block_tables), built with numpy, one host->device copy per tensor
      -> model.forward (one call) -> hidden [T, hidden]
      -> logits of each chunk that samples (its last token) -> Sampler -> ModelRunnerOutput
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.request import TokenLogprobs
from engine.sampler import Sampler
from engine.scheduler_output import ScheduledChunk, SchedulerOutput
from kernels.attention import AttentionMetadata

# Called after layer `layer_idx` wrote its KV, with the prefill chunks of the step.
LayerHook = Callable[[int, Sequence[ScheduledChunk]], None]


@dataclass
class ModelRunnerOutput:
    # request_id -> (sampled token, its logprobs if asked); only chunks with sample=True
    sampled: dict[str, tuple[int, TokenLogprobs | None]] = field(default_factory=dict)


@dataclass(frozen=True)
class _FlatBatch:
    chunks: list[ScheduledChunk]  # in batch order (decodes first)
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [num_sampling] rows of the last token of sampling chunks
    sampling_chunks: list[ScheduledChunk]


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        sampler: Sampler,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.sampler = sampler
        self.device = device

    @torch.inference_mode()
    def execute(
        self, scheduler_output: SchedulerOutput, on_layer_done: LayerHook | None = None
    ) -> ModelRunnerOutput:
        batch = self._build_batch(scheduler_output.chunks)
        layer_hook = None
        prefill_chunks = [c for c in batch.chunks if c.is_prefill]
        if on_layer_done is not None and prefill_chunks:

            def layer_hook(layer_idx: int) -> None:
                on_layer_done(layer_idx, prefill_chunks)

        hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta, layer_hook)
        output = ModelRunnerOutput()
        if not batch.sampling_chunks:
            return output
        logits = self.model.compute_logits(hidden[batch.logits_indices])  # [num_sampling, vocab]
        requests = [c.request for c in batch.sampling_chunks]
        sampled = self.sampler(logits, requests)
        for chunk, token_id, logprobs in zip(
            batch.sampling_chunks, sampled.token_ids, sampled.logprobs
        ):
            output.sampled[chunk.request.request_id] = (token_id, logprobs)
        return output

    def _build_batch(self, chunks: Sequence[ScheduledChunk]) -> _FlatBatch:
        # Decodes (one query token) first; stable, so the scheduler's order is kept otherwise.
        ordered = sorted(chunks, key=lambda c: c.num_new_tokens != 1)
        num_decodes = sum(1 for c in ordered if c.num_new_tokens == 1)
        query_lens = np.fromiter((c.num_new_tokens for c in ordered), np.int64, len(ordered))
        start_pos = np.fromiter((c.start_pos for c in ordered), np.int64, len(ordered))
        seq_lens = start_pos + query_lens
        cu_q = np.zeros(len(ordered) + 1, np.int64)
        np.cumsum(query_lens, out=cu_q[1:])
        num_tokens = int(cu_q[-1])

        # [T] request index of each token, and its position in the request
        token_req = np.repeat(np.arange(len(ordered)), query_lens)
        positions = np.arange(num_tokens) - cu_q[:-1][token_req] + start_pos[token_req]

        bs = self.block_size
        num_blocks_needed = (seq_lens + bs - 1) // bs
        block_tables = np.zeros((len(ordered), int(num_blocks_needed.max())), np.int32)
        for i, c in enumerate(ordered):
            n = int(num_blocks_needed[i])
            block_tables[i, :n] = c.block_ids[:n]
        slot_mapping = block_tables[token_req, positions // bs].astype(np.int64) * bs + positions % bs

        input_ids = np.fromiter(
            (t for c in ordered for t in c.token_ids), np.int64, num_tokens
        )
        sampling_rows = [i for i, c in enumerate(ordered) if c.sample]
        dev = self.device
        meta = AttentionMetadata(
            query_start_loc=torch.from_numpy(cu_q.astype(np.int32)).to(dev),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(dev),
            slot_mapping=torch.from_numpy(slot_mapping).to(dev),
            block_tables=torch.from_numpy(block_tables).to(dev),
            max_query_len=int(query_lens.max()),
            max_seq_len=int(seq_lens.max()),
            num_decodes=num_decodes,
            query_lens_cpu=tuple(query_lens.tolist()),
            seq_lens_cpu=tuple(seq_lens.tolist()),
        )
        return _FlatBatch(
            chunks=ordered,
            input_ids=torch.from_numpy(input_ids).to(dev),
            positions=torch.from_numpy(positions).to(dev),
            meta=meta,
            logits_indices=torch.from_numpy(cu_q[1:][sampling_rows] - 1).to(dev),
            sampling_chunks=[ordered[i] for i in sampling_rows],
        )
