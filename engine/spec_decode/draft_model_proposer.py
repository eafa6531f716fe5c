"""`DraftModelProposer`: a smaller model with the target's vocabulary drafts K tokens greedily.

```
load_draft_model   the draft LlamaForCausalLM on the target's device and dtype, checked:
                   same vocabulary, a context at least max_model_len
its KV             a KVCachePool of its own with the target's block count and block size,
                   addressed by the target's block ids: one ledger (KVCacheManager) for both,
                   so prefix hits, preemption and rollback hold for the draft's KV as well
observe(batch)     every target step's inputs run through the draft first (same tokens,
                   positions, slots; no logits): prompt chunks, recomputes after preemption
                   and verify tokens keep the draft's KV where the target's is
propose(chunks)    k forwards of one token per request (batched; CUDA graphs for decode like
                   the target's): forward j at position p + j reads the token forward j - 1
                   chose on the device (DeviceTokens, no sync), argmax -> draft j + 1; one
                   copy brings every draft to the host at the end
```

The drafts are the draft model's argmax, so its proposal distribution is one-hot and the
verify step's rule (engine/spec_decode/verification.py) leaves the target's distribution as
it is. The proposal forwards write the draft's KV at p .. p + k - 1, into slots the scheduler
allocated for the verify chunk; the verify step's observe writes them again with the tokens
that were verified.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.cuda_graphs import DecodeGraphs
from engine.host_copy import to_host_list
from engine.model import LoadedModel
from engine.model.arch_config import ModelArchConfig
from engine.scheduler_output import PENDING, DeviceTokens, ScheduledChunk
from engine.spec_decode.proposer import Proposer
from engine.step_inputs import FlatBatch, StepInputBuilder


def check_draft_arch(draft: ModelArchConfig, target: ModelArchConfig, max_model_len: int) -> None:
    """Refuse a draft model that cannot draft for `target` (ValueError saying why)."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"the speculative model's vocabulary has {draft.vocab_size} tokens but the model's "
            f"has {target.vocab_size}: a draft model must share the target's vocabulary (for "
            f"synthetic:<shape>, add :vocab={target.vocab_size})"
        )
    if draft.max_position_embeddings < max_model_len:
        raise ValueError(
            f"the speculative model's context length ({draft.max_position_embeddings}) is below "
            f"max_model_len ({max_model_len}): lower --max-model-len (or, for synthetic:<shape>, "
            f"add :max_len={max_model_len})"
        )


class DraftModelProposer(Proposer):
    name = "draft"

    def __init__(
        self,
        loaded: LoadedModel,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        inputs: StepInputBuilder,
        graphs: DecodeGraphs | None = None,
        verify_graphs: DecodeGraphs | None = None,
    ) -> None:
        """`kv_caches`: the draft's pool, as many blocks as the target's (same ids);
        `inputs`: a builder of its own (its buffers) with the target's block size and scratch
        block; `graphs` / `verify_graphs`: its decode forward captured for 1 and K + 1 query
        tokens per request (CUDA)."""
        self.loaded = loaded
        self.model = loaded.model
        self.kv_caches = kv_caches
        self.inputs = inputs
        self.graphs = graphs
        self.verify_graphs = verify_graphs

    @torch.inference_mode()
    def observe(self, batch: FlatBatch) -> None:
        """The target's step through the draft model: its KV for the same tokens and slots."""
        graphs = self._graphs_for(batch)
        if graphs is not None:
            graphs.run(batch)
            return
        self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta)

    @torch.inference_mode()
    def propose(self, chunks: Sequence[ScheduledChunk]) -> list[list[int]]:
        num_steps = max((c.num_lookahead_tokens for c in chunks), default=0)
        launched: list[tuple[list[int], torch.Tensor]] = []  # (chunk indices, their drafts)
        prev: DeviceTokens | None = None
        for j in range(num_steps):
            active = [i for i, c in enumerate(chunks) if c.num_lookahead_tokens > j]
            step = [_draft_chunk(chunks[i], j) for i in active]
            ids = self._decode(step, prev)  # [len(active)] on the device
            prev = DeviceTokens(ids, {chunks[i].request: row for row, i in enumerate(active)})
            launched.append((active, ids))
        drafts: list[list[int]] = [[] for _ in chunks]
        if not launched:
            return drafts
        host = to_host_list(torch.cat([ids for _, ids in launched]))  # the one sync
        offset = 0
        for active, _ in launched:
            for row, i in enumerate(active):
                drafts[i].append(host[offset + row])
            offset += len(active)
        return drafts

    def _decode(self, step: list[ScheduledChunk], prev: DeviceTokens | None) -> torch.Tensor:
        """One draft forward of one token per request; its argmax ids on the device."""
        pad_to = self.graphs.padded_size(len(step)) if self.graphs is not None else None
        batch = self.inputs.build(step, pad_to, prev)
        graphs = self._graphs_for(batch)
        if graphs is not None:
            hidden = graphs.run(batch)
        else:
            hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta)
        return self.model.compute_logits(hidden[: len(step)]).argmax(dim=-1)

    def _graphs_for(self, batch: FlatBatch) -> DecodeGraphs | None:
        if not batch.is_decode_only:
            return None
        return self.graphs if batch.meta.decode_query_len == 1 else self.verify_graphs


def _draft_chunk(chunk: ScheduledChunk, j: int) -> ScheduledChunk:
    """The request's j-th proposal forward: its last token (j = 0) or the draft forward j - 1
    chose (PENDING, read on the device), at position start + j."""
    token = chunk.token_ids[0] if j == 0 else PENDING
    if token == PENDING and j == 0:
        raise ValueError(f"request {chunk.request.request_id!r}: drafting needs its last token")
    return ScheduledChunk(chunk.request, [token], chunk.start_pos + j, chunk.block_ids, True)
