"""A request's state inside the engine: tokens, progress, blocks, lifecycle status."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.structured import CompiledGrammar, GrammarMatcher


class RequestStatus(enum.IntEnum):
    WAITING = 0  # queued; prefills from num_computed_tokens (0, or a prefix-cache hit)
    RUNNING = 1  # scheduled every step until it finishes
    PREEMPTED = 2  # blocks taken back; waits again and recomputes prompt + output so far
    PREFILLED = 3  # prefill-only mode: first token out, blocks held until release()
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probability of one sampled token (from the raw logits) and its top-n alternatives."""

    token_id: int
    logprob: float
    rank: int  # 1 = most likely
    top: tuple[tuple[int, float], ...] = ()  # (token_id, logprob), most likely first


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)

    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose KV is in the cache (or queued on the device)
    # Tokens sampled by launched steps whose ids are still on the device (async scheduling:
    # at most 2; the next step reads the last one there). Not in output_token_ids yet.
    num_pending_tokens: int = 0
    num_cached_tokens: int = 0  # of those, tokens found in the prefix cache at admission
    num_preemptions: int = 0
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # its full blocks' digests, cached
    # Draft tokens handed in for its next step (speculative decoding: a peer proposed them
    # after the first token); the next verify step takes them instead of proposing.
    draft_token_ids: list[int] = field(default_factory=list)
    # Its prefix-cache namespace within the deployment's (pdserve.block_hash.root_hash): the
    # router's digest of its tenant and client salt; "" shares the deployment's.
    cache_salt: str = ""
    # Whether its KV may enter the prefix cache: False for KV received from a peer that proved
    # nothing (an open cluster), so a forged hand-off never serves another request.
    cache_kv: bool = True
    # Structured outputs (engine/structured/): the compiled grammar it was made with, and once
    # added, its own matcher, advanced by every output token (None: unconstrained).
    grammar: CompiledGrammar | None = None
    matcher: GrammarMatcher | None = None
    # prompt_logprobs: entry p is prompt token p + 1's, computed from position p's hidden state
    # (so far; the prompt's first token has none); sent once, with its first output token.
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs_sent: bool = False

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Asked for prompt logprobs that are not all computed yet."""
        return (
            self.sampling_params.prompt_logprobs is not None
            and len(self.prompt_logprobs) < self.prompt_len - 1
        )

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_sampled_tokens(self) -> int:
        """Output tokens sampled so far, pending ones included: the index of the next draw."""
        return len(self.output_token_ids) + self.num_pending_tokens

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self.status)
