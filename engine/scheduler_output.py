"""What the scheduler hands to the model runner for one step."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

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

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def end_pos(self) -> int:
        return self.start_pos + len(self.token_ids)

    @property
    def is_prefill(self) -> bool:
        """Runs prompt tokens (first or later chunk, or a recompute after preemption)."""
        return self.start_pos < self.request.prompt_len or len(self.token_ids) > 1


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
