"""`GrammarMatcher`: one request's position in its grammar.

```
CompiledGrammar.new_matcher() -> GrammarMatcher (start of the grammar)
  accept_token(t) / accept_tokens([t...]) -> how many were accepted   (each output token)
  fill_bitmask(bitmask, row)      the allowed next tokens, one bit per token id
  validate_tokens([t...]) -> n    how many of these the grammar allows in a row, no change
  rollback(n)                     forget the last n accepted tokens
  is_terminated                   the grammar ended (its EOS accepted), or the matcher failed
```

Speculative decoding (later): verify checks K draft tokens with `validate_tokens` (or accepts
them with `accept_tokens` and rolls back the rejected tail with `rollback`); a mask per draft
position is the same `fill_bitmask` between accepts. Until then a constrained request runs
without speculation. A token the grammar refuses puts llguidance's matcher in an error state it
never leaves, so `accept_tokens` validates before it consumes.
"""

from __future__ import annotations

from collections.abc import Sequence

import llguidance
import llguidance.torch
import torch


class GrammarMatcher:
    def __init__(self, matcher: llguidance.LLMatcher, eos_token_ids: tuple[int, ...]) -> None:
        self._matcher = matcher
        self.eos_token_ids = eos_token_ids
        self.num_accepted_tokens = 0

    @property
    def llg_matcher(self) -> llguidance.LLMatcher:
        """The library's matcher (for a batched mask fill, `TokenBitmask`)."""
        return self._matcher

    @property
    def is_terminated(self) -> bool:
        """No token may follow: the grammar is complete and its EOS was accepted, or the
        matcher failed (`error`)."""
        return bool(self._matcher.is_stopped() or self._matcher.is_error())

    @property
    def error(self) -> str:
        """Why the matcher failed (a refused token, a limit hit mid-output); "" if it did not."""
        return str(self._matcher.get_error())

    def accept_token(self, token_id: int) -> bool:
        """Advance by one output token; False (and the matcher failed) if the grammar refuses
        it."""
        accepted = bool(self._matcher.consume_token(token_id))
        self.num_accepted_tokens += accepted
        return accepted

    def accept_tokens(self, token_ids: Sequence[int]) -> int:
        """Advance by the longest prefix of `token_ids` the grammar allows; how many that was.
        The matcher stays usable when a token is refused (the state after the prefix)."""
        num_valid = self.validate_tokens(token_ids)
        if num_valid and not self._matcher.consume_tokens(list(token_ids[:num_valid])):
            raise RuntimeError(f"the grammar refused tokens it had validated: {self.error}")
        self.num_accepted_tokens += num_valid
        return num_valid

    def validate_tokens(self, token_ids: Sequence[int]) -> int:
        """How many leading tokens of `token_ids` the grammar allows, without advancing."""
        return int(self._matcher.validate_tokens(list(token_ids)))

    def rollback(self, num_tokens: int) -> None:
        """Forget the last `num_tokens` accepted tokens."""
        if not 0 <= num_tokens <= self.num_accepted_tokens:
            raise ValueError(
                f"cannot roll back {num_tokens} tokens of {self.num_accepted_tokens} accepted"
            )
        if num_tokens and not self._matcher.rollback(num_tokens):
            raise RuntimeError(f"rollback of {num_tokens} tokens failed: {self.error}")
        self.num_accepted_tokens -= num_tokens

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` (CPU int32 [rows, ceil(V/32)]:
        bit t % 32 of word t // 32 set = token t allowed)."""
        llguidance.torch.fill_next_token_bitmask(self._matcher, bitmask, row)
