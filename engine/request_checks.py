"""Stop checks on a request's last output token, and the refusal of a request that could
never run (both the scheduler's, read on their own: what ends a request, what never starts)."""

from __future__ import annotations

from collections.abc import Container

from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus
from pdserve.config import SchedulerConfig
from pdserve.sampling_params import InvalidRequestError


def stop_status(request: Request, max_model_len: int) -> RequestStatus | None:
    """The status the request's last output token finishes it with, or None: "stop" (EOS
    unless ignored, a stop token, once min_tokens are out) wins over "length" (max_tokens, or
    the context full)."""
    params = request.sampling_params
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
