"""`KVSuffix`: the part of a prompt's KV one hand-off carries.

A decode node that holds the prompt's first `num_cached_blocks` full blocks already (prefix
hits of its own cache: a conversation's earlier turns) reserves blocks only for the rest, and
its ticket says how many it holds. The hand-off then carries the prompt's tokens from
`cached_tokens` on, as whole blocks from block `num_cached_blocks`:

```
prompt blocks    [0 ........ num_cached_blocks) [num_cached_blocks ..... ceil(num_tokens / bs))
                  held by the receiver: skipped   sent; the ticket's dst_block_ids[0:num_blocks]
manifest         block_offset, num_blocks: indices into dst_block_ids (prompt block - cached)
                 token_end: prompt tokens, counted from the prompt's start
```

A cached block is always full, so the suffix starts on a block boundary: no block is shared
between what the receiver holds and what it receives. At least one prompt token is always
sent (the receiver's lookup leaves the last one out), so every layer has a span.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVSuffix:
    block_size: int
    num_tokens: int  # the prompt's tokens
    num_cached_blocks: int = 0  # leading full blocks the receiver holds already

    def __post_init__(self) -> None:
        if self.num_tokens < 1:
            raise ValueError(f"num_tokens must be > 0 (the prompt length), got {self.num_tokens}")
        if not 0 <= self.cached_tokens < self.num_tokens:
            raise ValueError(
                f"num_cached_blocks {self.num_cached_blocks} of {self.block_size} tokens must "
                f"leave at least one of the prompt's {self.num_tokens} tokens to send"
            )

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens the receiver holds already: where every layer's KV starts."""
        return self.num_cached_blocks * self.block_size

    @property
    def num_blocks(self) -> int:
        """Blocks the hand-off fills (per layer)."""
        return -(-self.num_tokens // self.block_size) - self.num_cached_blocks

    def span(self, prev_end: int, token_end: int) -> tuple[int, int]:
        """The (first, end) indices into the ticket's dst_block_ids of a layer's tokens
        [prev_end, token_end) (prev_end >= cached_tokens)."""
        first = prev_end // self.block_size - self.num_cached_blocks
        return first, -(-token_end // self.block_size) - self.num_cached_blocks
