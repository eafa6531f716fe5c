"""`SpecDecoder`: the engine's speculative decoding, as the scheduler and the runner see it.

```
Scheduler._schedule_running   num_lookahead(request): draft slots after a decoding request's
                              last token (K; fewer near max_tokens or the context's end; 0
                              when it opted out), allocated with it and counted in the budget
EngineCore.step               fill_drafts(output): each such chunk becomes a verify chunk
                              [last, d_1 .. d_k] (drafts handed in with the request first,
                              else the proposer's); k may be below the slots, even 0
ModelRunner                   observe(batch) before the target's forward; the sampler's rows
                              (verification.sampling_rows): k + 1 per verify chunk
Scheduler.update_from_output  land(chunk, targets): the accepted prefix + the target's token;
                              the rejected drafts' KV slots are given back (rollback)
```
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, TokenLogprobs
from engine.scheduler_output import ScheduledChunk, SchedulerOutput
from engine.spec_decode.proposer import Proposer
from engine.spec_decode.stats import SpecDecodeStats
from engine.spec_decode.verification import num_accepted
from engine.step_inputs import FlatBatch

Sampled = tuple[int, TokenLogprobs | None]


class SpecDecoder:
    def __init__(self, proposer: Proposer, num_speculative_tokens: int, pad_drafts: bool = False):
        """`pad_drafts`: give every verify chunk of a step as many drafts as it has slots
        (repeating its last token), so that the step keeps one shape (a CUDA graph's); off, a
        chunk verifies only what the proposer found."""
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        self.proposer = proposer
        self.num_speculative_tokens = num_speculative_tokens
        self.pad_drafts = pad_drafts
        self.stats = SpecDecodeStats()

    @staticmethod
    def speculates(request: Request) -> bool:
        """Not when it opted out, nor when it is constrained (structured outputs): its drafts
        are not checked against the grammar, so it decodes one token a step."""
        return (
            request.sampling_params.speculative
            and request.grammar is None
            and request.matcher is None
        )

    def num_lookahead(self, request: Request, max_model_len: int) -> int:
        """Draft slots for a decoding request's next step: at most K, and no draft past the
        request's last possible token (max_tokens, the context length)."""
        if not self.speculates(request):
            return 0
        tokens_left = min(
            request.sampling_params.max_tokens - request.num_sampled_tokens,
            max_model_len - request.num_tokens - request.num_pending_tokens,
        )  # the step emits up to drafts + 1 of them
        return max(0, min(self.num_speculative_tokens, tokens_left - 1))

    def any_speculates(self, running: Mapping[str, Request]) -> bool:
        """Whether a running request speculates: its next step's inputs wait for this one's."""
        return any(map(self.speculates, running.values()))

    def allocate_draft_slots(
        self,
        request: Request,
        num_new_tokens: int,
        budget: int,
        kv_cache_manager: KVCacheManager,
        max_model_len: int,
    ) -> int:
        """For a running request's next chunk of `num_new_tokens`: if it is a decode of a token
        known on the host, draft slots after it within `budget`, allocated with it (the chunk's
        blocks too); 0 (nothing allocated) otherwise or when the pool cannot hold them."""
        if num_new_tokens != 1 or request.num_pending_tokens or not request.output_token_ids:
            return 0  # a prompt chunk, a recompute, or a token still on the device
        num_slots = min(self.num_lookahead(request, max_model_len), budget - 1)
        if num_slots > 0 and kv_cache_manager.allocate_slots(request, 1 + num_slots):
            return num_slots
        return 0

    def fill_drafts(
        self, scheduler_output: SchedulerOutput, kv_cache_manager: KVCacheManager
    ) -> None:
        """Turn each chunk with draft slots into a verify chunk (in place); the blocks of
        slots left without a draft go back at once."""
        chunks = scheduler_output.chunks
        slotted = [i for i, c in enumerate(chunks) if c.num_lookahead_tokens]
        if not slotted:
            return
        to_propose = [i for i in slotted if not chunks[i].request.draft_token_ids]
        proposed = self.proposer.propose([chunks[i] for i in to_propose]) if to_propose else []
        drafts = dict(zip(to_propose, proposed))
        for i in slotted:
            if i not in drafts:
                drafts[i] = _take_handed_in(chunks[i].request)
        pad = self.pad_drafts and any(drafts.values())  # no draft at all: a plain decode step
        for i in slotted:
            chunk = chunks[i]
            found = drafts[i][: chunk.num_lookahead_tokens]
            if pad:
                fill = found[-1] if found else chunk.token_ids[-1]
                found = found + [fill] * (chunk.num_lookahead_tokens - len(found))
            if len(found) < chunk.num_lookahead_tokens:
                kv_cache_manager.free_tail(chunk.request, chunk.start_pos + 1 + len(found))
            chunks[i] = dataclasses.replace(
                chunk, token_ids=chunk.token_ids + found, num_draft_tokens=len(found),
                block_ids=chunk.request.block_ids,
            )  # fmt: skip

    def observe(self, batch: FlatBatch) -> None:
        self.proposer.observe(batch)

    def land(self, chunk: ScheduledChunk, targets: Sequence[Sampled]) -> tuple[list[Sampled], int]:
        """A verify chunk's tokens to emit, and how many drafts were accepted: the accepted
        drafts (with the target's logprobs there), then the target's own token after them.
        `targets`: x_0 .. x_k, what the target sampled at each of the chunk's positions."""
        drafts = chunk.token_ids[1:]
        if len(targets) != len(drafts) + 1:
            raise ValueError(
                f"request {chunk.request.request_id!r}: {len(drafts)} drafts need "
                f"{len(drafts) + 1} sampled rows, got {len(targets)}"
            )
        accepted = num_accepted(drafts, [token for token, _ in targets])
        return list(targets[: accepted + 1]), accepted


def _take_handed_in(request: Request) -> list[int]:
    """Drafts handed in with the request (the first verify step after a hand-off), once."""
    drafts, request.draft_token_ids = request.draft_token_ids, []
    return drafts
