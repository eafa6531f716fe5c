"""Stop checks on a request's last output token, and the refusal of a request that could
never run (the engine's and the scheduler's, read on their own: what ends a request, what
never starts)."""

from __future__ import annotations

from collections.abc import Container, Sequence

from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus
from pdserve.config import SchedulerConfig
from pdserve.sampling_params import InvalidRequestError, SamplingParams


def stop_status(request: Request, max_model_len: int) -> RequestStatus | None:
    """The status the request's last output token finishes it with, or None: "stop" (EOS
    unless ignored, a stop token, once min_tokens are out; its grammar ended) wins over
    "length" (max_tokens, or the context full); a grammar that failed aborts it."""
    params = request.sampling_params
    if request.matcher is not None and request.matcher.is_terminated:
        failed = bool(request.matcher.error)
        return RequestStatus.FINISHED_ABORTED if failed else RequestStatus.FINISHED_STOPPED
    num_output_tokens = len(request.output_token_ids)
    if num_output_tokens >= params.min_tokens:
        last_token_id = request.output_token_ids[-1]
        if (not params.ignore_eos and last_token_id in request.eos_token_ids) or (
            last_token_id in params.stop_token_ids
        ):
            return RequestStatus.FINISHED_STOPPED
    if num_output_tokens >= params.max_tokens or request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None


def check_request(
    prompt_token_ids: Sequence[int],
    params: SamplingParams,
    vocab_size: int,
    max_model_len: int,
    num_kv_tokens: int,
    tensor_parallel: bool = False,
) -> None:
    """Refuse a request this engine cannot serve: ids beyond the vocabulary (prompt,
    logit_bias), bad sampling values, more tokens than the context or the whole KV cache;
    prompt logprobs with tensor parallelism (their LM-head slices would be collectives the
    worker ranks do not run)."""
    if len(prompt_token_ids) == 0:
        raise InvalidRequestError("the prompt is empty: send at least one token")
    bad = [t for t in prompt_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"prompt token ids must be in [0, {vocab_size}); got {bad[:5]}")
    params.validate()
    bad = [t for t in params.logit_bias if t >= vocab_size]
    if bad:
        raise InvalidRequestError(
            f"logit_bias token ids must be in [0, {vocab_size}); got {bad[:5]}", "logit_bias"
        )
    if tensor_parallel and params.prompt_logprobs is not None:
        raise InvalidRequestError(
            "prompt_logprobs is not served with tensor parallelism yet", "prompt_logprobs"
        )
    total = len(prompt_token_ids) + params.max_tokens
    if total > max_model_len:
        raise InvalidRequestError(
            f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) = "
            f"{total} exceeds the context length {max_model_len}; shorten the prompt or "
            f"lower max_tokens"
        )
    if total > num_kv_tokens:
        raise InvalidRequestError(
            f"prompt + max_tokens = {total} tokens exceeds the whole KV cache "
            f"({num_kv_tokens} tokens); lower max_tokens"
        )


def check_scheduler_config(config: SchedulerConfig, max_model_len: int) -> None:
    """Refuse limits under which some request could never be scheduled."""
    if config.max_num_batched_tokens < 1 or config.max_num_seqs < 1:
        raise ValueError(
            "max_num_batched_tokens and max_num_seqs must be >= 1, got "
            f"{config.max_num_batched_tokens} and {config.max_num_seqs}"
        )
    if not config.enable_chunked_prefill and config.max_num_batched_tokens < max_model_len:
        raise ValueError(
            f"max_num_batched_tokens ({config.max_num_batched_tokens}) is below max_model_len "
            f"({max_model_len}) with chunked prefill disabled, so a long prompt could never be "
            "scheduled: enable chunked prefill, raise max_num_batched_tokens or lower "
            "max_model_len"
        )


def check_admissible(
    request: Request,
    ids_in_use: Container[str],
    max_model_len: int,
    kv_cache_manager: KVCacheManager,
) -> None:
    """Refuse a request that could never run, rather than let it wait forever."""
    request_id = request.request_id
    if request_id in ids_in_use:
        raise InvalidRequestError(f"request id {request_id!r} is already in use")
    if not 0 < request.prompt_len <= max_model_len:
        raise InvalidRequestError(
            f"request {request_id!r}: the prompt has {request.prompt_len} tokens; it needs "
            f"between 1 and max_model_len ({max_model_len})"
        )
    # The last token is never run, so the KV covers at most num_tokens - 1 tokens.
    max_kv_len = min(request.prompt_len + request.sampling_params.max_tokens - 1, max_model_len)
    block_size = kv_cache_manager.block_size
    num_total_blocks = kv_cache_manager.num_total_blocks
    if max_kv_len > num_total_blocks * block_size:
        raise InvalidRequestError(
            f"request {request_id!r} may need KV for {max_kv_len} tokens but the whole cache "
            f"holds {num_total_blocks * block_size}; lower max_tokens or enlarge the cache"
        )


def check_prefilled(request: Request, block_size: int) -> None:
    """`Scheduler.add_prefilled`'s precondition: every token but the last (the first sampled
    one) computed, in blocks that cover them."""
    num_kv_slots = len(request.block_ids) * block_size
    if request.num_computed_tokens != request.num_tokens - 1 or num_kv_slots < (
        request.num_computed_tokens
    ):
        raise ValueError(
            f"request {request.request_id!r}: add_prefilled needs num_computed_tokens == "
            f"num_tokens - 1 and block_ids covering them; got {request.num_computed_tokens} "
            f"computed of {request.num_tokens} tokens, {len(request.block_ids)} blocks"
        )
