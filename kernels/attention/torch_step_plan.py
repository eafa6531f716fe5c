"""The torch backend's step plan: everything a step's attention needs that depends only on its
`AttentionMetadata` (length groups of the decodes, the flat block ids each gather reads, the
causal masks, the prefill padding map). `TorchAttentionBackend` builds one per step and every
layer reuses it (torch_backend.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.attention.metadata import AttentionMetadata


@dataclass(frozen=True)
class AttentionGroup:
    """Rows attended by one padded SDPA, and what its gather and mask need."""

    rows: torch.Tensor | None  # [n] int64 rows of the part (decodes / prefills); None: all
    num_rows: int
    block_ids: torch.Tensor  # [n * blocks_per_row] int64: the blocks the gather reads, flat
    max_len: int  # keys per row (the longest context of the group)
    mask: torch.Tensor  # [n, 1, max_q_len, max_len] bool: key visible to query
    # One row whose blocks are consecutive (block_ids[0], block_ids[0] + 1, ...), on CPU: its
    # context is a view of the cache and nothing is gathered (a lone request's usual case).
    first_block: int | None = None


@dataclass(frozen=True)
class PrefillPlan:
    group: AttentionGroup  # all prefill requests, one SDPA
    flat_idx: torch.Tensor  # [num_prefill_tokens] int64: token's row in [n * max_q_len]
    max_q_len: int


@dataclass(frozen=True)
class StepPlan:
    decode_groups: list[AttentionGroup]
    prefill: PrefillPlan | None


def make_group(
    block_tables: torch.Tensor,  # [n, max_blocks_per_req] int32, the group's rows
    q_positions: torch.Tensor,  # [n, max_q_len] int64, position of each query
    max_len: int,
    block_size: int,
    rows: torch.Tensor | None = None,
) -> AttentionGroup:
    num_blocks = -(-max_len // block_size)
    block_ids = block_tables[:, :num_blocks].reshape(-1).long()
    # A real query's position is < its seq_len, so the causal test also hides the rest of the
    # last block and block-table padding. Padded query rows see at least key 0 (no NaN).
    mask = torch.arange(max_len, device=q_positions.device) <= q_positions[:, :, None]
    first_block = None
    if block_ids.device.type == "cpu" and block_tables.shape[0] == 1:
        ids = block_ids.tolist()
        if ids == list(range(ids[0], ids[0] + num_blocks)):
            first_block = ids[0]
    return AttentionGroup(
        rows, block_tables.shape[0], block_ids, max_len, mask[:, None], first_block
    )


MAX_DECODE_GROUPS = 4
_GROUP_LEN_RATIO = 0.7  # a group's shortest context is at least this fraction of its longest


def length_groups(seq_lens: tuple[int, ...]) -> list[tuple[list[int], int]]:
    """Split request rows into at most MAX_DECODE_GROUPS groups of similar length, longest
    first: [(rows, max_len)]. One group when the lengths are already close."""
    order = sorted(range(len(seq_lens)), key=seq_lens.__getitem__, reverse=True)
    groups: list[tuple[list[int], int]] = []
    start = 0
    for i in range(1, len(order) + 1):
        last_group = len(groups) == MAX_DECODE_GROUPS - 1
        if i == len(order) or (
            not last_group and seq_lens[order[i]] < _GROUP_LEN_RATIO * seq_lens[order[start]]
        ):
            groups.append((order[start:i], seq_lens[order[start]]))
            start = i
    return groups


def decode_groups(meta: AttentionMetadata, block_size: int) -> list[AttentionGroup]:
    """One group per set of similar context lengths (at most `MAX_DECODE_GROUPS`): padding
    every decode to the longest context wastes up to half the gathered KV when lengths are
    spread, and the gather is most of decode attention's cost. A static-shape batch is one
    group padded to the block tables' capacity (no host decision on its lengths)."""
    num_decodes, query_len = meta.num_decodes, meta.decode_query_len
    offsets = torch.arange(-query_len, 0, device=meta.seq_lens.device)  # [Q]: -Q .. -1
    positions = meta.seq_lens[:num_decodes].long()[:, None] + offsets  # [num_decodes, Q]
    block_tables = meta.block_tables[:num_decodes]
    if meta.static_shapes:
        return [make_group(block_tables, positions, meta.max_seq_len, block_size)]
    groups = length_groups(meta.seq_lens_cpu[:num_decodes])
    if len(groups) == 1:
        return [make_group(block_tables, positions, groups[0][1], block_size)]
    plans = []
    for rows, max_len in groups:
        idx = torch.tensor(rows, device=positions.device)
        plans.append(
            make_group(
                block_tables.index_select(0, idx),
                positions.index_select(0, idx),
                max_len,
                block_size,
                rows=idx,
            )
        )
    return plans


def prefill_plan(meta: AttentionMetadata, block_size: int) -> PrefillPlan:
    """Where each prefill token sits in the padded [num_prefills, max_q_len] layout, and the
    prefills' single group."""
    first = meta.num_decodes
    num_prefills = meta.num_reqs - first
    num_prefill_tokens = meta.num_tokens - meta.num_decode_tokens
    device = meta.seq_lens.device
    query_start_loc = meta.query_start_loc[first:].long() - meta.query_start_loc[first]
    query_lens = query_start_loc[1:] - query_start_loc[:-1]  # [num_prefills]
    req_idx = torch.repeat_interleave(
        torch.arange(num_prefills, device=device), query_lens, output_size=num_prefill_tokens
    )
    token_idx = torch.arange(num_prefill_tokens, device=device) - query_start_loc[req_idx]
    max_q_len = max(meta.query_lens_cpu[first:])
    context_lens = meta.seq_lens[first:].long() - query_lens  # tokens cached before this step
    q_positions = context_lens[:, None] + torch.arange(max_q_len, device=device)
    max_len = max(meta.seq_lens_cpu[first:])
    group = make_group(meta.block_tables[first:], q_positions, max_len, block_size)
    return PrefillPlan(group, req_idx * max_q_len + token_idx, max_q_len)


def step_plan(meta: AttentionMetadata, block_size: int, plan_decodes: bool = True) -> StepPlan:
    """The step's groups; `plan_decodes` False: no decode groups (the decode kernel reads the
    block tables itself)."""
    decodes = decode_groups(meta, block_size) if plan_decodes and meta.num_decodes > 0 else []
    prefill = prefill_plan(meta, block_size) if meta.num_reqs > meta.num_decodes else None
    return StepPlan(decodes, prefill)
