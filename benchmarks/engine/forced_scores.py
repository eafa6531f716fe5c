"""Teacher-forced next-token distributions from an offline engine, many sequences per batch,
and the quality metrics of one KV dtype's distributions against another's.

```
score(llm, sequences, first_positions)
  one llm.generate of every sequence with prompt_logprobs (so no prefix-cache hit: every
  position is computed, its attention reading the KV the prefill just stored, quantized
  under FP8) -> at each step, for each sequence's chunk, the hidden rows of positions
  >= first_position -> log_softmax(compute_logits(rows)) -> [len - 1 - first, vocab] per
  sequence (row i predicts token first + 1 + i)
```

The rows are taken where the engine launches its prompt logprobs (`engine.model_runner`'s
`launch_prompt_logprobs`, wrapped for the call and restored after), from the spans that
function computes, so chunked prefills and mixed batches map row by row.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

import engine.model_runner as model_runner
from engine.llm import LLM
from engine.model.llama import LlamaForCausalLM
from engine.prompt_logprobs import PendingPromptLogprobs, prompt_spans
from engine.step_inputs import FlatBatch
from pdserve.sampling_params import SamplingParams

Rows = dict[tuple[int, ...], dict[int, torch.Tensor]]  # sequence -> position -> log-probs


@contextmanager
def _recording(first: dict[tuple[int, ...], int], rows: Rows) -> Iterator[None]:
    real = model_runner.launch_prompt_logprobs

    def launch(
        model: LlamaForCausalLM, batch: FlatBatch, hidden: torch.Tensor
    ) -> PendingPromptLogprobs | None:
        for span in prompt_spans(batch):
            key = tuple(span.request.prompt_token_ids)
            lo = max(span.first_pos, first.get(key, span.first_pos + span.num_pos))
            hi = span.first_pos + span.num_pos
            if lo < hi:
                start = span.first_row + lo - span.first_pos
                logits = model.compute_logits(hidden[start : start + hi - lo]).float()
                logprobs = torch.log_softmax(logits, dim=-1).cpu()
                rows.setdefault(key, {}).update({lo + i: logprobs[i] for i in range(hi - lo)})
        return real(model, batch, hidden)

    model_runner.launch_prompt_logprobs = launch
    try:
        yield
    finally:
        model_runner.launch_prompt_logprobs = real


def score(
    llm: LLM, sequences: Sequence[Sequence[int]], first_positions: Sequence[int]
) -> list[torch.Tensor]:
    """Per sequence, [len - 1 - first, vocab] float32 log-probs of the next token at positions
    first .. len - 2 (CPU tensors), all sequences in one batch."""
    first = {tuple(s): f for s, f in zip(sequences, first_positions)}
    rows: Rows = {}
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    with _recording(first, rows):
        llm.generate([list(s) for s in sequences], params)
    out = []
    for seq, lo in zip(sequences, first_positions):
        got = rows.get(tuple(seq), {})
        wanted = range(lo, len(seq) - 1)
        if any(p not in got for p in wanted):
            raise RuntimeError(f"positions {lo}..{len(seq) - 2} not all scored: {sorted(got)}")
        out.append(torch.stack([got[p] for p in wanted]))
    return out


@dataclass
class Tally:
    """Teacher-forced metrics of distributions q (the KV dtype under test) against p (the
    baseline), position by position over the baseline's greedy tokens."""

    prefix_tokens: int  # "identical first N": N
    num_prompts: int = 0
    num_positions: int = 0
    top1_same: int = 0  # argmax q == argmax p
    base_self_same: int = 0  # argmax p (prefill) == the baseline's own greedy token (decode)
    prefix_identical: int = 0  # q's argmax is the greedy token at each of the first N positions
    all_identical: int = 0  # ... at every position
    kls: list[torch.Tensor] = field(default_factory=list)

    def add(self, p: torch.Tensor, q: torch.Tensor, tokens: Sequence[int]) -> None:
        """p, q: [n, vocab] log-probs at the positions that predicted `tokens` (n of them)."""
        p64, q64 = p.double(), q.double()
        self.kls.append((p64.exp() * (p64 - q64)).sum(-1))  # KL(p || q) per position
        greedy = torch.tensor(list(tokens))
        q_top, p_top = q.argmax(-1), p.argmax(-1)
        self.num_prompts += 1
        self.num_positions += len(tokens)
        self.top1_same += int((q_top == p_top).sum())
        self.base_self_same += int((p_top == greedy).sum())
        run = int(torch.cumprod((q_top == greedy).int(), 0).sum())  # leading matches
        self.prefix_identical += run >= min(self.prefix_tokens, len(tokens))
        self.all_identical += run == len(tokens)

    def rows(self) -> list[tuple[str, float]]:
        kl = torch.cat(self.kls) if self.kls else torch.zeros(1, dtype=torch.float64)
        n, m = max(self.num_positions, 1), max(self.num_prompts, 1)
        return [
            ("top-1 agreement (positions)", self.top1_same / n),
            (f"identical first {self.prefix_tokens} greedy tokens", self.prefix_identical / m),
            ("identical whole greedy output", self.all_identical / m),
            ("mean KL(baseline || test) (nats)", float(kl.mean())),
            ("max KL (nats)", float(kl.max())),
            ("baseline prefill argmax = its greedy", self.base_self_same / n),
        ]
