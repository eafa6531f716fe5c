"""`Proposer`: what drafts tokens for the verify step (engine/spec_decode/README in
engine/README.md's "Speculative decoding").

```
schedule()  a decoding request that speculates gets a chunk [last token] with
            `num_lookahead_tokens` = k draft slots allocated after it (k <= K)
propose()   up to k draft tokens per such chunk, from what the host knows (its tokens) or a
            draft model run on the device
observe()   the step's inputs, before the target runs them (a draft model keeps its KV for the
            same tokens in the same block ids)
```
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from engine.scheduler_output import ScheduledChunk
    from engine.step_inputs import FlatBatch


class Proposer(ABC):
    """Drafts tokens for decoding requests; one per engine."""

    name: ClassVar[str]

    @abstractmethod
    def propose(self, chunks: Sequence[ScheduledChunk]) -> list[list[int]]:
        """For each chunk (a decode whose `token_ids` is the request's last token, known on the
        host, with `num_lookahead_tokens` > 0 draft slots): at most that many draft tokens to
        follow it, possibly none."""

    def observe(self, batch: FlatBatch) -> None:  # noqa: B027 (optional hook)
        """The target's step inputs, before its forward (nothing by default)."""
