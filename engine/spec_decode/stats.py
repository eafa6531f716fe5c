"""`SpecDecodeStats`: what speculation drafted and what the target accepted, since start."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SpecDecodeStats:
    num_verifies: int = 0  # verify chunks landed (one request's drafts in one step)
    num_draft_tokens: int = 0  # draft tokens verified
    num_accepted_tokens: int = 0  # of those, accepted (emitted as they were)
    num_emitted_tokens: int = 0  # tokens the verifies emitted (accepted + the target's own)

    def record(self, num_drafts: int, num_accepted: int, num_emitted: int) -> None:
        self.num_verifies += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        self.num_emitted_tokens += num_emitted

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted (0 before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_emitted_per_verify(self) -> float:
        """Tokens a verify step emits per request on average (1 + accepted drafts, fewer where
        a stop ends the run)."""
        return self.num_emitted_tokens / self.num_verifies if self.num_verifies else 0.0
