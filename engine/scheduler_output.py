"""What the scheduler hands to the model runner for one step."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.block_hash import request_token_ids
from engine.request import Request

if TYPE_CHECKING:
    import torch

# A decode's input token that the previous step, still running, samples on the device (async
# scheduling): the model runner reads it there (`DeviceTokens`).
PENDING = -1


@dataclass(frozen=True)
class DeviceTokens:
    """A launched step's sampled ids, still on the device, and each request's row in them:
    where the next step's `PENDING` inputs, and its penalties' pending tokens, are found."""

    token_ids: torch.Tensor  # [num_sampled] int64
    rows: Mapping[Request, int]


@dataclass(frozen=True)
class ScheduledChunk:
    """One request's slice of a step: tokens [start_pos, start_pos + num_new_tokens)."""

    request: Request
    token_ids: list[int]  # the tokens to run this step ([PENDING]: see above)
    start_pos: int  # position of token_ids[0] (= request.num_computed_tokens when scheduled)
    block_ids: list[int]  # the request's whole block table (covers start_pos + len(token_ids))
    # True when this chunk reaches the end of the request's known tokens, so the step samples
    # its next token. False for a non-final chunk of a chunked prefill.
    sample: bool
    # Speculative decoding (engine/spec_decode). A decode's draft slots: block space for this
    # many tokens after token_ids, allocated and counted in the step's budget; the proposer
    # fills up to that many (`SpecDecoder.fill_drafts`).
    num_lookahead_tokens: int = 0
    # A verify chunk: token_ids = [last token, d_1 .. d_k], k = num_draft_tokens drafts; the
    # step samples each of its k + 1 positions and keeps the accepted prefix.
    num_draft_tokens: int = 0

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def end_pos(self) -> int:
        return self.start_pos + len(self.token_ids)

    @property
    def is_prefill(self) -> bool:
        """Runs prompt tokens (first or later chunk, or a recompute after preemption)."""
        num_known = len(self.token_ids) - self.num_draft_tokens
        return self.start_pos < self.request.prompt_len or num_known > 1

    @property
    def num_sampled_rows(self) -> int:
        """Positions the step samples: its last token's, and each draft's (0: no sample)."""
        return 1 + self.num_draft_tokens if self.sample else 0


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks

    @property
    def has_grammar(self) -> bool:
        """A chunk samples under a grammar (structured outputs: its mask needs the matcher)."""
        return any(c.sample and c.request.matcher is not None for c in self.chunks)


def next_chunk(request: Request, num_new_tokens: int, num_lookahead: int = 0) -> ScheduledChunk:
    """The next `num_new_tokens` of `request` (and `num_lookahead` draft slots after them), as
    the scheduler hands them out; a token still pending on the device (at most one, the last:
    `Scheduler.schedule_ahead`) is `PENDING`."""
    start_pos = request.num_computed_tokens
    end_pos = start_pos + num_new_tokens
    token_ids = request_token_ids(request, start_pos, end_pos)
    token_ids += [PENDING] * (num_new_tokens - len(token_ids))
    return ScheduledChunk(
        request=request,
        token_ids=token_ids,
        start_pos=start_pos,
        block_ids=request.block_ids,  # not copied: only appended to until the step ends
        sample=end_pos == request.num_tokens + request.num_pending_tokens,
        num_lookahead_tokens=num_lookahead,
    )
