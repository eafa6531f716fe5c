"""Typed results that leave the engine: one `StepOutput` per request per step, a
`PrefillLayerChunk` per prefill chunk for the per-layer hook, and the offline API's
`RequestOutput`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.request import FinishReason, Request, TokenLogprobs


@dataclass(frozen=True)
class StepOutput:
    """What one `EngineCore.step()` produced for one request."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    finish_reason: FinishReason | None = None  # set on the request's last output
    # Prefill-only mode: the request's prompt KV is complete and its first token sampled;
    # its blocks stay held until `EngineCore.release(request_id)`.
    prefill_done: bool = False
    num_cached_tokens: int = 0
    # prompt_logprobs asked: with the request's first token, one entry per prompt token (the
    # first None: nothing precedes it), each the prompt token's logprob given its prefix
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @classmethod
    def of_request(
        cls,
        request: Request,
        token_id: int | None,
        logprobs: TokenLogprobs | None = None,
        prefill_done: bool = False,
    ) -> StepOutput:
        """`request`'s output of this step: `token_id` (None: no new token) as it now stands."""
        return cls(
            request_id=request.request_id,
            new_token_ids=[] if token_id is None else [token_id],
            new_logprobs=None if logprobs is None else [logprobs],
            finish_reason=request.finish_reason,
            prefill_done=prefill_done,
            num_cached_tokens=request.num_cached_tokens,
        )

    @classmethod
    def of_tokens(
        cls, request: Request, tokens: Sequence[tuple[int, TokenLogprobs | None]]
    ) -> StepOutput:
        """`request`'s output of a step that emitted several tokens (a speculative verify
        step's accepted run), each with its logprobs where asked."""
        logprobs = [lp for _, lp in tokens if lp is not None]
        return cls(
            request_id=request.request_id,
            new_token_ids=[token_id for token_id, _ in tokens],
            new_logprobs=logprobs or None,
            finish_reason=request.finish_reason,
            num_cached_tokens=request.num_cached_tokens,
        )


@dataclass(frozen=True, slots=True)
class PrefillLayerChunk:
    """What the per-layer hook's consumer may read of one request's prefill chunk in a step:
    a snapshot built once per step, not the live request (the engine thread owns that)."""

    request_id: str
    start_pos: int  # position of the chunk's first token
    num_tokens: int  # tokens the step runs for it: [start_pos, start_pos + num_tokens)
    prompt_len: int
    block_ids: tuple[int, ...]  # the request's block table this step (covers end_pos)

    @property
    def end_pos(self) -> int:
        return self.start_pos + self.num_tokens

    @property
    def ends_prompt(self) -> bool:
        """The step computes the prompt's last token: its KV is complete after this step."""
        return self.end_pos == self.prompt_len


@dataclass
class RequestOutput:
    """Offline API result for one prompt (vLLM-like, flattened to the single completion)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    logprobs: list[TokenLogprobs] | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
