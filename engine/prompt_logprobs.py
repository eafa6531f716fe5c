"""Prompt logprobs (vLLM's `prompt_logprobs=N`, OpenAI's `echo` with `logprobs`): each prompt
token's logprob given the tokens before it, its rank, and the top-N at its position.

```
a prefill chunk [start, end) of a request that asked, in the step's hidden states
  positions p in [max(start, done), min(end, prompt_len - 1)): row p predicts prompt token p+1
  -> compute_logits on at most `rows_per_slice` rows at a time (memory bounded: never the
     chunk's full-vocabulary logits at once) -> log_softmax -> the target's logprob and rank,
     top-N -> one packed copy to the host, waited for with the step's tokens
```

`done` is how many positions the request already has: a chunk recomputed after preemption
adds nothing twice. The first prompt token has no logprob (None where they are sent). A request
asking for prompt logprobs takes no prefix-cache hit until they are all computed (its cached
positions have no hidden states). Logprobs are of the raw logits, as the sampled tokens'.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.host_copy import HostCopy, on_device
from engine.outputs import StepOutput
from engine.request import Request, TokenLogprobs
from engine.scheduler_output import SchedulerOutput
from engine.step_inputs import FlatBatch

if TYPE_CHECKING:
    from engine.model.llama import LlamaForCausalLM

PromptLogprobResults = Mapping[str, tuple[int, list[TokenLogprobs]]]

# About this many bytes of float32 [rows, vocab] temporaries at once (logits, log-softmax,
# the rank comparison): 341 rows of a 49k vocabulary, 130 of a 128k one.
SLICE_BYTES = 192 << 20


@dataclass(frozen=True)
class PromptSpan:
    """Positions [first_pos, first_pos + num_pos) of a request, at `first_row` of the step."""

    request: Request
    first_row: int
    first_pos: int
    num_pos: int


def prompt_spans(batch: FlatBatch) -> list[PromptSpan]:
    """The step's rows whose prompt logprobs are still to compute, request by request."""
    spans: list[PromptSpan] = []
    row = 0
    for chunk in batch.chunks:  # rows of the flat batch, in this order
        request = chunk.request
        if request.wants_prompt_logprobs:
            first = max(chunk.start_pos, len(request.prompt_logprobs))
            last = min(chunk.end_pos, request.prompt_len - 1)
            if first < last:
                spans.append(
                    PromptSpan(request, row + first - chunk.start_pos, first, last - first)
                )
        row += chunk.num_new_tokens
    return spans


@dataclass
class PendingPromptLogprobs:
    """Launched prompt logprobs: their packed copy to the host under way."""

    spans: list[PromptSpan]
    num_top: int
    copy: HostCopy

    def result(self) -> PromptLogprobResults:
        """request_id -> (first position, one TokenLogprobs per position) (waits for the copy)."""
        packed = self.copy.tolist()
        num_rows = sum(span.num_pos for span in self.spans)
        logprobs, ranks = packed[:num_rows], packed[num_rows : 2 * num_rows]
        top = packed[2 * num_rows :]
        results: dict[str, tuple[int, list[TokenLogprobs]]] = {}
        row = 0
        for span in self.spans:
            request, num = span.request, span.request.sampling_params.prompt_logprobs or 0
            entries = []
            for j in range(row, row + span.num_pos):
                base = j * 2 * self.num_top
                ids, lps = (
                    top[base : base + num],
                    top[base + self.num_top : base + self.num_top + num],
                )
                entries.append(
                    TokenLogprobs(
                        token_id=request.prompt_token_ids[span.first_pos + j - row + 1],
                        logprob=logprobs[j],
                        rank=int(ranks[j]),
                        top=tuple((int(t), lp) for t, lp in zip(ids, lps)),
                    )
                )
            results[request.request_id] = (span.first_pos, entries)
            row += span.num_pos
        return results


@torch.inference_mode()
def launch_prompt_logprobs(
    model: LlamaForCausalLM, batch: FlatBatch, hidden: torch.Tensor
) -> PendingPromptLogprobs | None:
    """Queue the prompt logprobs of the step's chunks that need them; None when none does."""
    spans = prompt_spans(batch)
    if not spans:
        return None
    device = hidden.device
    rows = [s.first_row + k for s in spans for k in range(s.num_pos)]
    targets = [
        s.request.prompt_token_ids[s.first_pos + k + 1] for s in spans for k in range(s.num_pos)
    ]
    num_top = max(s.request.sampling_params.prompt_logprobs or 0 for s in spans)
    row_idx, target_ids = on_device(rows, device), on_device(targets, device)
    parts: list[list[torch.Tensor]] = [[], [], []]  # logprob, rank, top (ids then logprobs)
    vocab_size = model.arch.vocab_size
    rows_per_slice = max(1, SLICE_BYTES // (12 * vocab_size))
    for start in range(0, len(rows), rows_per_slice):
        index = row_idx[start : start + rows_per_slice]
        logprobs = torch.log_softmax(model.compute_logits(hidden[index]).float(), dim=-1)
        target = logprobs.gather(1, target_ids[start : start + rows_per_slice].unsqueeze(1))
        parts[0].append(target.view(-1))
        parts[1].append((logprobs > target).sum(dim=-1).float() + 1)  # [n]
        top_lp, top_ids = logprobs.topk(min(num_top, vocab_size), dim=-1)  # [n, num_top]
        parts[2].append(torch.cat([top_ids.double(), top_lp.double()], dim=1).view(-1))
    packed = torch.cat([torch.cat(p).double() for p in parts])
    return PendingPromptLogprobs(spans, num_top, HostCopy(packed))


def with_prompt_logprobs(
    outputs: list[StepOutput], scheduler_output: SchedulerOutput, results: PromptLogprobResults
) -> list[StepOutput]:
    """Land a step's prompt logprobs in their requests, and attach each request's whole list
    (None for the first prompt token) to its first output that carries a token. A request
    whose prompt KV came from a peer (`add_prefilled`) computed none here: it gets none (the
    prefill node sends them)."""
    requests = {c.request.request_id: c.request for c in scheduler_output.chunks}
    for request_id, (first_pos, entries) in results.items():
        request = requests[request_id]
        request.prompt_logprobs.extend(entries[len(request.prompt_logprobs) - first_pos :])
    attached = []
    for output in outputs:
        owner = requests.get(output.request_id)
        if (
            owner is not None
            and output.new_token_ids
            and owner.sampling_params.prompt_logprobs is not None
            and not owner.prompt_logprobs_sent
            and not owner.wants_prompt_logprobs  # all computed here (not: KV from a peer)
        ):
            owner.prompt_logprobs_sent = True
            output = dataclasses.replace(output, prompt_logprobs=[None, *owner.prompt_logprobs])
        attached.append(output)
    return attached
