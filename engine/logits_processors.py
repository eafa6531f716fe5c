"""The sampler's logits processors, each vectorized over the rows that need it: penalties
(repetition, frequency, presence), logit_bias, min_tokens masking, top-k / top-p and min-p."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from engine.host_copy import on_device
from engine.request import Request
from engine.scheduler_output import DeviceTokens


def _token_counts(
    token_lists: list[list[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """How often each token occurs in each list: [len(token_lists), vocab_size] float32."""
    num_rows = len(token_lists)
    lengths = on_device([len(t) for t in token_lists], device)  # [num_rows]
    flat_ids = on_device(
        list(itertools.chain.from_iterable(token_lists)), device, torch.long
    )  # [total_tokens]
    # output_size known on the host: no sync to size the result
    rows = torch.repeat_interleave(
        torch.arange(num_rows, device=device), lengths, output_size=flat_ids.numel()
    )
    counts = torch.zeros(num_rows * vocab_size, dtype=torch.float32, device=device)
    counts.scatter_add_(
        0, rows * vocab_size + flat_ids, torch.ones_like(flat_ids, dtype=torch.float32)
    )
    return counts.view(num_rows, vocab_size)


def apply_penalties(
    logits: torch.Tensor, requests: Sequence[Request], pending: DeviceTokens | None = None
) -> torch.Tensor:
    """Repetition penalty over prompt + output tokens (divides positive logits, multiplies
    negative ones), then frequency and presence penalties over output tokens (vLLM order); a
    request's output includes its token still pending on the device (async scheduling: found
    in `pending`, counted there). Only rows with a penalty are touched; returns a new tensor
    when any row is."""
    rows = [i for i, r in enumerate(requests) if r.sampling_params.has_penalties]
    if not rows:
        return logits
    counted: list[tuple[int, int]] = []  # (penalized row, row in pending.token_ids)
    for j, i in enumerate(rows):
        request = requests[i]
        if request.num_pending_tokens == 0:
            continue
        if request.num_pending_tokens > 1 or pending is None or request not in pending.rows:
            raise ValueError(
                f"request {request.request_id!r} has {request.num_pending_tokens} pending "
                "tokens: penalties need each of them on the device (pending)"
            )
        counted.append((j, pending.rows[request]))
    device, vocab_size = logits.device, logits.shape[1]
    params = [requests[i].sampling_params for i in rows]
    row_idx = on_device(rows, device)
    penalized = logits[row_idx]  # [num_rows, vocab]
    output_counts = _token_counts([requests[i].output_token_ids for i in rows], vocab_size, device)
    if counted and pending is not None:  # the pending tokens, on the device: one more each
        at = on_device([j for j, _ in counted], device)
        token_ids = pending.token_ids[on_device([k for _, k in counted], device)]
        ones = torch.ones(len(counted), dtype=output_counts.dtype, device=device)
        output_counts.index_put_((at, token_ids), ones, accumulate=True)
    output_seen = output_counts > 0  # [num_rows, vocab]

    if any(p.repetition_penalty != 1.0 for p in params):
        prompt_counts = _token_counts(
            [requests[i].prompt_token_ids for i in rows], vocab_size, device
        )
        repetition = on_device([p.repetition_penalty for p in params], device)
        repetition = torch.where(output_seen | (prompt_counts > 0), repetition.unsqueeze(1), 1.0)
        penalized = torch.where(penalized > 0, penalized / repetition, penalized * repetition)

    frequency = on_device([p.frequency_penalty for p in params], device)
    presence = on_device([p.presence_penalty for p in params], device)
    penalized = penalized - frequency.unsqueeze(1) * output_counts
    penalized = penalized - presence.unsqueeze(1) * output_seen
    return logits.index_copy(0, row_idx, penalized)


def apply_logit_bias(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """Add each request's `logit_bias` (token id -> bias) to its row; a new tensor when any
    request has one (ids were checked against the vocabulary when the request was made)."""
    rows: list[int] = []
    token_ids: list[int] = []
    biases: list[float] = []
    for i, request in enumerate(requests):
        bias = request.sampling_params.logit_bias
        rows += [i] * len(bias)
        token_ids += bias.keys()
        biases += bias.values()
    if not rows:
        return logits
    device = logits.device
    index = (on_device(rows, device), on_device(token_ids, device))
    return logits.index_put(index, on_device(biases, device, logits.dtype), accumulate=True)


def apply_min_tokens(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """Mask EOS (unless ignore_eos) and stop_token_ids while a request's output is shorter
    than min_tokens. Returns a new tensor when any row is masked. A request under a grammar
    is left alone: its grammar decides where the output may end."""
    vocab_size = logits.shape[1]
    rows: list[int] = []
    token_ids: list[int] = []
    for i, request in enumerate(requests):
        params = request.sampling_params
        if request.num_sampled_tokens >= params.min_tokens or request.matcher is not None:
            continue
        banned = set(params.stop_token_ids)
        if not params.ignore_eos:
            banned.update(request.eos_token_ids)
        banned_ids = [t for t in banned if t < vocab_size]
        rows += [i] * len(banned_ids)
        token_ids += banned_ids
    if not rows:
        return logits
    index = (on_device(rows, logits.device), on_device(token_ids, logits.device))
    return logits.index_put(index, logits.new_full((), float("-inf")))


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask with -inf what lies outside each row's top-k (ties with the k-th value kept) and
    outside its top-p nucleus (the smallest top set whose probability reaches top_p).
    top_k: [num_rows] long in [1, vocab]; top_p: [num_rows] float in (0, 1]."""
    sorted_logits, sorted_idx = logits.sort(dim=-1)  # ascending, [num_rows, vocab]
    vocab_size = logits.shape[1]
    if top_k is not None:
        kth_largest = sorted_logits.gather(1, (vocab_size - top_k).unsqueeze(1))  # [num_rows, 1]
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_largest, float("-inf"))
    if top_p is not None:
        cum_probs = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # ascending mass
        drop = cum_probs <= (1.0 - top_p).unsqueeze(1)
        drop[:, -1] = False  # always keep the most likely token
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zero the tokens whose probability is below min_p times the row's top probability.
    probs: [num_rows, vocab]; min_p: [num_rows]."""
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)  # [num_rows, 1]
    return probs.masked_fill(probs < threshold, 0.0)
