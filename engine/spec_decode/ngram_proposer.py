"""`NgramProposer`: prompt lookup. The longest suffix n-gram of a request's tokens (prompt +
output) found earlier in them proposes the tokens that followed it there.

```
tokens  t_0 ... t_{L-1}          (a per-request numpy copy, appended to as the output grows)
match   ends j < L - 1 with t_j == t_{L-1}; extended backwards one offset at a time while
        t_{j-m} == t_{L-1-m}, up to max_n: each end's match length, all ends at once (numpy)
choose  the longest match (>= min_n); among equals one followed by k tokens (a repeating
        tail's latest match is followed by few), the latest of those (the most recent context)
draft   t_{j+1} ... t_{j+k}      (fewer where the tokens end first)
```

Vectorised over the tokens: the Python loop runs over the offsets m (at most max_n), never over
tokens. A proposal costs O(L) for the first comparison plus O(candidates x max_n).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import numpy as np

from engine.request import Request
from engine.scheduler_output import ScheduledChunk
from engine.spec_decode.proposer import Proposer


def ngram_lookup(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """Up to `k` tokens that followed the latest of the longest earlier occurrences of the
    suffix of `tokens` (an n-gram, min_n <= n <= max_n); empty when none occurs."""
    num_tokens = tokens.shape[0]
    if num_tokens < 2 or k < 1:
        return tokens[:0]
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])  # candidate match ends, j < L - 1
    lengths = np.ones(ends.shape[0], np.int64)
    alive = np.ones(ends.shape[0], bool)
    for m in range(1, max_n):
        if not alive.any():
            break
        starts = ends - m  # the token m before each end; t_{L-1-m} exists since j < L - 1
        alive &= starts >= 0
        alive[alive] = tokens[starts[alive]] == tokens[num_tokens - 1 - m]
        lengths += alive
    if not ends.size or lengths.max() < min_n:
        return tokens[:0]
    longest = ends[lengths == lengths.max()]
    available = np.minimum(num_tokens - 1 - longest, k)  # tokens that followed, up to k
    start = int(longest[available == available.max()][-1]) + 1
    return tokens[start : start + k]


class _TokenBuffer:
    """A request's prompt + output tokens as a growing int64 array (appended, never rebuilt)."""

    def __init__(self, request: Request) -> None:
        self.array = np.empty(max(64, 2 * request.num_tokens), np.int64)
        self.length = 0

    def sync(self, request: Request) -> np.ndarray:
        prompt_len, total = request.prompt_len, request.num_tokens
        if total > self.array.shape[0]:
            grown = np.empty(2 * total, np.int64)
            grown[: self.length] = self.array[: self.length]
            self.array = grown
        if self.length < prompt_len:
            self.array[:prompt_len] = request.prompt_token_ids
            self.length = prompt_len
        if self.length < total:
            self.array[self.length : total] = request.output_token_ids[self.length - prompt_len :]
            self.length = total
        return self.array[:total]


class NgramProposer(Proposer):
    name = "ngram"

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n} and {max_n}")
        self.min_n = min_n
        self.max_n = max_n
        # Dropped with the request (no hook needed when it finishes or is aborted).
        self._buffers: weakref.WeakKeyDictionary[Request, _TokenBuffer] = (
            weakref.WeakKeyDictionary()
        )

    def propose(self, chunks: Sequence[ScheduledChunk]) -> list[list[int]]:
        drafts = []
        for chunk in chunks:
            request = chunk.request
            buffer = self._buffers.get(request)
            if buffer is None:
                buffer = self._buffers[request] = _TokenBuffer(request)
            tokens = buffer.sync(request)
            found = ngram_lookup(tokens, self.min_n, self.max_n, chunk.num_lookahead_tokens)
            drafts.append(found.tolist())
        return drafts
