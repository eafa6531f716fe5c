"""The verify step's sampling: each draft position is sampled as a plain decode would be, and
a draft is accepted while it equals what the target sampled there.

```
verify chunk   tokens [t, d_1 .. d_k] at positions p .. p + k (t: the last token, d: drafts)
sampler rows   k + 1 rows, row j = the request as it would be after d_1 .. d_j: output so far
               + d_1 .. d_j (penalties count them), draw index n + j (seeded noise from
               (seed, n + j), min_tokens), logprobs of the raw logits
               -> x_j, the token a plain decode would sample at output index n + j
accept         a = the longest prefix with d_{j+1} == x_j; emit x_0 .. x_a (the accepted
               drafts, then the target's own token after them)
```

Why this is speculative rejection sampling (Leviathan et al., Chen et al.) for a proposer whose
distribution q is one-hot (n-gram lookup and the greedy draft model both are): x_j is drawn from
the target's distribution p_j (after penalties, temperature, top-k/p, min-p), so the draft is
accepted with probability p_j(d) = min(1, p_j(d) / q_j(d)), and on rejection the emitted x_j
has the distribution p_j restricted to tokens != d, renormalised: (p_j - q_j)+ normalised, the
residual of the standard rule. The uniform of the accept test and the residual draw are one
exponential race seeded by (seed, output index), so a seeded request's token at each index is
the one it gets without speculation (up to float rounding of the logits), in any batch. Greedy
rows are the special case x_j = argmax.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.request import Request
from engine.scheduler_output import ScheduledChunk


def sampling_rows(chunks: Sequence[ScheduledChunk]) -> list[Request]:
    """The sampler's rows for a step's sampling chunks: a chunk's request, or for a verify
    chunk (k drafts) k + 1 views of its request, view j as if d_1 .. d_j had been sampled.
    A view shares the request's prompt list and params; its output list is a copy only where
    penalties read it."""
    rows: list[Request] = []
    for chunk in chunks:
        if not chunk.num_draft_tokens:
            rows.append(chunk.request)
            continue
        request = chunk.request
        if request.num_pending_tokens:
            raise ValueError(
                f"request {request.request_id!r}: a verify step needs its tokens on the host "
                "(no pending token)"
            )
        drafts = chunk.token_ids[1:]
        for j in range(len(drafts) + 1):
            rows.append(_row_view(request, drafts[:j]))
    return rows


def _row_view(request: Request, drafts: list[int]) -> Request:
    """`request` after `drafts` were sampled: what the sampler reads (params, EOS ids, prompt,
    output for penalties, num_sampled_tokens for the draw index and min_tokens)."""
    if request.sampling_params.has_penalties:
        output, pending = request.output_token_ids + drafts, 0
    else:  # only the count is read: no copy
        output, pending = request.output_token_ids, len(drafts)
    return Request(
        request_id=request.request_id,
        prompt_token_ids=request.prompt_token_ids,
        sampling_params=request.sampling_params,
        eos_token_ids=request.eos_token_ids,
        arrival_time=request.arrival_time,
        output_token_ids=output,
        num_pending_tokens=pending,
    )


def num_accepted(draft_token_ids: Sequence[int], target_token_ids: Sequence[int]) -> int:
    """How many leading drafts equal the target's tokens at their positions (x_0 .. x_{k-1})."""
    for j, (draft, target) in enumerate(zip(draft_token_ids, target_token_ids)):
        if draft != target:
            return j
    return min(len(draft_token_ids), len(target_token_ids))
