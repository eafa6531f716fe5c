"""The batch's grammar masks: filled on the host, applied to the logits on their device.

```
sampling rows' matchers (None: unconstrained) ── build ──► None when every row is free
  constrained rows: host bitmask [n, ceil(V/32)] int32 (pinned on CUDA), one row each,
  filled by llguidance (in parallel past a few rows when num_mask_threads > 1)
  ── one non-blocking copy ──► GrammarMask(rows, bits) on the device
Sampler: apply_grammar_mask(logits, mask): the constrained rows' refused tokens -> -inf
```

Only a step with a constrained request pays; an unconstrained batch never reaches here. A
matcher that terminated (its request ends with this step's token, whose result is dropped)
or failed gets an all-allowed row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import llguidance
import llguidance.torch
import torch

from engine.host_copy import on_device
from engine.structured.grammar_matcher import GrammarMatcher

_PARALLEL_MIN_ROWS = 8  # below this the executor's hand-off costs more than it saves


@dataclass(frozen=True)
class GrammarMask:
    """The constrained rows of a step and their allowed tokens, on the logits' device."""

    rows: torch.Tensor  # [n] int64: rows of the sampled batch
    bits: torch.Tensor  # [n, ceil(vocab / 32)] int32: bit t % 32 of word t // 32 = t allowed


class TokenBitmask:
    """Builds `GrammarMask`es; reuses one host buffer (pinned on CUDA), grown as needed."""

    def __init__(self, vocab_size: int, device: torch.device, num_threads: int = 1) -> None:
        self.vocab_size = vocab_size
        self.num_words = (vocab_size + 31) // 32
        self.device = device
        self._pin = device.type == "cuda"
        self._host = torch.empty((0, self.num_words), dtype=torch.int32)
        self._copied: torch.cuda.Event | None = None  # the last copy out of _host
        self._executor = llguidance.LLExecutor(num_threads) if num_threads > 1 else None

    def build(self, matchers: Sequence[GrammarMatcher | None]) -> GrammarMask | None:
        """The mask of the rows whose matcher is set (row i: `matchers[i]`); None if none is."""
        rows = [i for i, matcher in enumerate(matchers) if matcher is not None]
        if not rows:
            return None
        host = self._host_rows(len(rows))
        live: list[tuple[llguidance.LLMatcher, int]] = []
        for j, i in enumerate(rows):
            matcher = matchers[i]
            assert matcher is not None
            if matcher.is_terminated:
                host[j].fill_(-1)
            else:
                live.append((matcher.llg_matcher, j))
        self._fill(host, live)
        if not self._pin:
            return GrammarMask(on_device(rows, self.device), host.clone())
        bits = host.to(self.device, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record(torch.cuda.current_stream(self.device))
        return GrammarMask(on_device(rows, self.device), bits)

    def _host_rows(self, num_rows: int) -> torch.Tensor:
        """The first `num_rows` rows of the host buffer, once its last copy has left it."""
        if self._copied is not None:
            self._copied.synchronize()  # long done: a step's whole forward ran since
            self._copied = None
        if self._host.shape[0] < num_rows:
            self._host = torch.empty(
                (max(num_rows, 2 * self._host.shape[0]), self.num_words),
                dtype=torch.int32,
                pin_memory=self._pin,
            )
        return self._host[:num_rows]

    def _fill(self, host: torch.Tensor, live: list[tuple[llguidance.LLMatcher, int]]) -> None:
        if self._executor is not None and len(live) >= _PARALLEL_MIN_ROWS:
            llguidance.torch.fill_next_token_bitmask_par(self._executor, live, host)
            return
        for matcher, row in live:
            llguidance.torch.fill_next_token_bitmask(matcher, host, row)


def apply_grammar_mask(logits: torch.Tensor, mask: GrammarMask) -> torch.Tensor:
    """`logits` [num_rows, vocab] float with every token `mask` refuses at -inf in its rows;
    a new tensor (the raw logits stay as they were, for logprobs)."""
    num_rows, vocab_size = mask.bits.shape[0], logits.shape[1]
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = (mask.bits.unsqueeze(-1) >> shifts) & 1  # [n, words, 32]
    allowed = allowed.view(num_rows, -1)[:, :vocab_size].bool()  # [n, vocab]
    constrained = logits[mask.rows].masked_fill(~allowed, float("-inf"))
    return logits.index_copy(0, mask.rows, constrained)
