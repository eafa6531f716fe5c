"""The flat varlen batch description every attention backend consumes.

A step's tokens from all requests are concatenated: request i owns query rows
`query_start_loc[i]:query_start_loc[i+1]`. Its context after this step is `seq_lens[i]` tokens,
the first `seq_lens[i] - query_len_i` already in the paged cache, the rest being written this
step at `slot_mapping` (slot = block_id * block_size + offset). Requests are ordered decodes
first: the first `num_decodes` requests have exactly `decode_query_len` query tokens each, 1 for
plain decodes, K + 1 for a speculative verify batch (the last token and K draft tokens, causal
among themselves: query i of such a request sits at position seq_len - decode_query_len + i).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, cu_seqlens of the queries
    seq_lens: torch.Tensor  # [num_reqs] int32, context length including this step's tokens
    slot_mapping: torch.Tensor  # [num_tokens] int64, cache slot of each new token
    block_tables: torch.Tensor  # [num_reqs, max_blocks_per_req] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    num_decodes: int  # the first num_decodes requests have query length decode_query_len
    # Host copies, for backends (and the torch reference) that need Python ints.
    query_lens_cpu: tuple[int, ...]
    seq_lens_cpu: tuple[int, ...]
    # A decode-only batch of fixed shape (a CUDA graph's): the per-request host values above are
    # placeholders and max_seq_len is the block tables' capacity. Backends must then read
    # lengths from the device tensors only, with no host decision that depends on them.
    static_shapes: bool = False
    # Query tokens of each of the first num_decodes requests (> 1: a verify batch's decodes).
    decode_query_len: int = 1

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @property
    def num_decode_tokens(self) -> int:
        """Query rows of the decodes: rows [0, num_decode_tokens) of q and the output."""
        return self.num_decodes * self.decode_query_len
