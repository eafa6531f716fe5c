"""What a launched sampling gives back: `PendingSample` (the ids on the device, their copy
to the host queued) and, once waited for, `SamplerOutput`; a step whose requests asked for
logprobs packs them with the ids into the same one copy (`with_logprobs`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.host_copy import HostCopy, on_device
from engine.request import Request, TokenLogprobs


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]  # one per request, in batch order
    logprobs: list[TokenLogprobs | None]  # None for requests that did not ask


@dataclass
class PendingSample:
    """A launched sampling: the ids stay on the device for the next step to read, and one copy
    brings them (with any logprobs) to the host."""

    token_ids: torch.Tensor  # [num_reqs] int64, on the logits' device
    copy: HostCopy
    unpack: Callable[[list], SamplerOutput]

    def result(self) -> SamplerOutput:
        """Wait for the copy (GIL released) and unpack it."""
        return self.unpack(self.copy.tolist())


def with_logprobs(
    raw_logits: torch.Tensor,
    token_ids: torch.Tensor,  # [num_reqs] on the device
    requests: Sequence[Request],
    rows: list[int],  # the rows that asked for logprobs
) -> PendingSample:
    """The token ids, and for `rows` the sampled token's logprob and rank under the raw logits
    and the top-n alternatives; everything comes back to the host in one copy."""
    device, vocab_size = raw_logits.device, raw_logits.shape[1]
    row_idx = on_device(rows, device)
    logprobs = torch.log_softmax(raw_logits[row_idx].float(), dim=-1)  # [num_rows, vocab]
    sampled = token_ids[row_idx].unsqueeze(1)  # [num_rows, 1]
    sampled_logprobs = logprobs.gather(1, sampled)  # [num_rows, 1]
    ranks = (logprobs > sampled_logprobs).sum(dim=-1, keepdim=True) + 1  # [num_rows, 1]
    counts = [requests[i].sampling_params.logprobs or 0 for i in rows]  # (all set in `rows`)
    num_top = min(max(counts), vocab_size)
    top_logprobs, top_ids = logprobs.topk(num_top, dim=-1)  # [num_rows, num_top]
    # float64 holds the ids, ranks and float32 logprobs exactly: one tensor, one copy.
    packed = torch.cat(
        [token_ids.double(), sampled_logprobs.double().view(-1), ranks.double().view(-1),
         top_ids.double().view(-1), top_logprobs.double().view(-1)]
    )  # fmt: skip
    return PendingSample(
        token_ids,
        HostCopy(packed),
        lambda host: _unpack_logprobs(host, len(requests), rows, counts, num_top),
    )


def _unpack_logprobs(
    packed: list, num_reqs: int, rows: list[int], counts: list[int], num_top: int
) -> SamplerOutput:
    """`with_logprobs`'s packed host list -> SamplerOutput."""
    num_rows = len(rows)
    ids = [int(t) for t in packed[:num_reqs]]
    sampled_list = packed[num_reqs : num_reqs + num_rows]
    ranks_list = packed[num_reqs + num_rows : num_reqs + 2 * num_rows]
    tops_start = num_reqs + 2 * num_rows
    top_ids_flat = packed[tops_start : tops_start + num_rows * num_top]
    top_lp_flat = packed[tops_start + num_rows * num_top :]
    result: list[TokenLogprobs | None] = [None] * num_reqs
    for j, (i, num) in enumerate(zip(rows, counts)):
        first = j * num_top
        result[i] = TokenLogprobs(
            token_id=ids[i],
            logprob=sampled_list[j],
            rank=int(ranks_list[j]),
            top=tuple(
                (int(t), lp)
                for t, lp in zip(
                    top_ids_flat[first : first + num], top_lp_flat[first : first + num]
                )
            ),
        )
    return SamplerOutput(ids, result)
