"""A verify step's results into its request: the accepted tokens, each stop-checked, and the
rollback of what the rejected drafts took.

```
targets x_0 .. x_k  -> SpecDecoder.land: emit = accepted drafts + the target's token after them
append one by one   stop checks after each (EOS, stop token, max_tokens, context length); a
                    stop ends the run there and the tokens after it are dropped
rollback            num_computed_tokens = num_tokens - 1: the KV of the last emitted token is
                    not computed (it runs next step), the rejected drafts' KV is ignored and
                    overwritten later; full blocks of accepted tokens enter the prefix cache,
                    blocks only the rejected slots used are freed (never cached)
```
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus, TokenLogprobs
from engine.request_checks import stop_status
from engine.scheduler_output import ScheduledChunk
from engine.spec_decode.spec_decoder import Sampled, SpecDecoder


def land_verified(
    spec: SpecDecoder,
    chunk: ScheduledChunk,
    targets: Sequence[Sampled],
    kv_cache_manager: KVCacheManager,
    max_model_len: int,
) -> tuple[list[Sampled], RequestStatus | None]:
    """Append a verify chunk's emitted tokens to its request and roll its KV ledger back to
    them; (the tokens emitted, the status a stop among them finishes it with, or None). The
    caller finishes a stopped request (which frees its blocks)."""
    request = chunk.request
    tokens, num_accepted = spec.land(chunk, targets)
    emitted: list[Sampled] = []
    status = None
    for token_id, logprobs in tokens:
        _append(request, token_id, logprobs)
        emitted.append((token_id, logprobs))
        status = stop_status(request, max_model_len)
        if status is not None:
            break
    spec.stats.record(chunk.num_draft_tokens, num_accepted, len(emitted))
    request.num_computed_tokens = request.num_tokens - 1
    kv_cache_manager.cache_full_blocks(request)
    if status is None:
        kv_cache_manager.free_tail(request, request.num_computed_tokens)
    return emitted, status


def _append(request: Request, token_id: int, logprobs: TokenLogprobs | None) -> None:
    request.output_token_ids.append(token_id)
    if logprobs is not None:
        request.output_logprobs.append(logprobs)
