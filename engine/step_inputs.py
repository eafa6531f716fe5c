"""A step's flat varlen inputs, built with numpy on the host and moved in one copy.

```
chunks (decodes first)
  -> numpy: input_ids, positions, slot_mapping [T]; seq_lens, query_start_loc [R(+1)];
            logits rows [S]; block_tables [R, W] (W: the widest request's blocks)
  -> one int64 host buffer (pinned on CUDA), one non-blocking copy to the device
  -> device views; the int32 fields cast on the device
```

A decode whose input is `PENDING` (async scheduling: the previous step, still running, samples
it) reads its token on the device: `DeviceTokens` says where in the previous step's sampled ids
it is, and one gather fills those rows after the copy.

A decode-only batch may be padded to `pad_to` rows (a CUDA graph's batch size): padded rows
decode token 0 at position 0 into the scratch block (`scratch_block`, never handed out), with a
context of one token, so they compute finite values that nobody reads. A speculative verify
batch whose chunks all verify the same number of drafts is a decode batch of Q = 1 + drafts
queries per row (`AttentionMetadata.decode_query_len`); its padded rows run Q tokens at
positions 0 .. Q - 1, every block-table column the scratch block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from engine.scheduler_output import PENDING, DeviceTokens, ScheduledChunk
from kernels.attention import AttentionMetadata


@dataclass(frozen=True)
class HostStep:
    """A step's inputs on the host, as one copy moves them to the device: int64 arrays in
    `FIELDS` order (block tables flattened, `block_table_width` wide). Rank 0 of a
    tensor-parallel group hands this to the other ranks, which build the same batch from it."""

    FIELDS: ClassVar[tuple[str, ...]] = (
        "input_ids", "positions", "slot_mapping", "seq_lens", "query_start_loc",
        "logits_rows", "block_tables", "pending_dst", "pending_src",
    )  # fmt: skip
    fields: tuple[np.ndarray, ...]
    block_table_width: int
    is_decode_only: bool
    decode_query_len: int = 1  # > 1: a speculative verify batch (AttentionMetadata's)

    @property
    def num_pending(self) -> int:
        """Decodes whose token the previous step samples on the device."""
        return int(self.fields[7].size)


@dataclass(frozen=True)
class FlatBatch:
    chunks: list[ScheduledChunk]  # in batch order (decodes first), real rows only
    input_ids: torch.Tensor  # [T] int64 (padded rows included)
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [num_sampled_rows] the last token's row of each sampling
    # chunk, every row of a verify chunk (ScheduledChunk.num_sampled_rows), in chunk order
    sampling_chunks: list[ScheduledChunk]
    is_decode_only: bool  # built with pad_to: decodes (of meta.decode_query_len) for a graph
    host: HostStep  # what the copy moved (what rank 0 hands the other tensor-parallel ranks)

    @property
    def num_rows(self) -> int:  # padded rows included
        return int(self.meta.seq_lens.shape[0])


@dataclass(frozen=True)
class _HostArrays:
    """A step's inputs on the host (R rows, padded ones included; T tokens)."""

    query_lens: np.ndarray  # [R]
    seq_lens: np.ndarray  # [R]
    cu_q: np.ndarray  # [R + 1] query_start_loc
    positions: np.ndarray  # [T]
    slot_mapping: np.ndarray  # [T]
    input_ids: np.ndarray  # [T] (a PENDING decode's token is filled in on the device)
    block_tables: np.ndarray  # [R, W]


class StepInputBuilder:
    """Builds `FlatBatch`es; reuses one pinned host buffer and one device buffer."""

    def __init__(self, block_size: int, scratch_block: int, device: torch.device) -> None:
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.device = device
        self._pin = device.type == "cuda"
        self._host = torch.empty(0, dtype=torch.int64)
        self._dev = torch.empty(0, dtype=torch.int64, device=device)
        self._copied: torch.cuda.Event | None = None  # the last copy out of _host

    def build(
        self,
        chunks: Sequence[ScheduledChunk],
        pad_to: int | None = None,
        prev: DeviceTokens | None = None,
    ) -> FlatBatch:
        """The step's inputs; `prev` provides the token of each `PENDING` decode."""
        # Decodes (one query token) first; stable, so the scheduler's order is kept otherwise.
        ordered = sorted(chunks, key=lambda c: c.num_new_tokens != 1)
        query_len = verify_query_len(ordered)  # > 1: every row a verify of this many tokens
        host = self._host_arrays(ordered, max(pad_to or 0, len(ordered)), query_len)
        sampling_rows = [i for i, c in enumerate(ordered) if c.sample]
        logits_rows = _logits_rows(ordered, sampling_rows, host.cu_q)
        pending_dst, pending_src = _pending_rows(ordered, prev)
        fields = (host.input_ids, host.positions, host.slot_mapping, host.seq_lens, host.cu_q,
                  logits_rows, host.block_tables.reshape(-1), pending_dst, pending_src)  # fmt: skip
        num_rows = host.query_lens.size
        num_decodes = np.count_nonzero(host.query_lens == query_len)
        decode_only = pad_to is not None and num_decodes == num_rows
        step = HostStep(fields, host.block_tables.shape[1], decode_only, query_len)
        sampling = [ordered[i] for i in sampling_rows]
        return self.from_host(step, prev.token_ids if prev else None, ordered, sampling)

    def from_host(
        self,
        step: HostStep,
        prev_token_ids: torch.Tensor | None,
        chunks: list[ScheduledChunk] | None = None,
        sampling_chunks: list[ScheduledChunk] | None = None,
    ) -> FlatBatch:
        """The device batch of `step` (one copy); `prev_token_ids`: the previous step's sampled
        ids, where `PENDING` decodes find their token. A tensor-parallel worker rank calls it
        with rank 0's `HostStep` (and no chunks: it only runs the forward)."""
        ids_d, pos_d, slots_d, seq_d, cu_d, rows_d, bt_d, dst_d, src_d = self._to_device(
            step.fields
        )
        if dst_d.numel():
            assert prev_token_ids is not None, "a PENDING decode needs the previous step's ids"
            ids_d.index_copy_(0, dst_d, prev_token_ids.index_select(0, src_d))
        seq_lens, cu_q = step.fields[3], step.fields[4]
        query_lens = np.diff(cu_q)
        query_len = step.decode_query_len
        meta = AttentionMetadata(
            query_start_loc=cu_d.int(),
            seq_lens=seq_d.int(),
            slot_mapping=slots_d,
            block_tables=bt_d.view(seq_lens.size, step.block_table_width).int(),
            max_query_len=int(query_lens.max()),
            max_seq_len=int(seq_lens.max()),
            num_decodes=int(np.count_nonzero(query_lens == query_len)),
            query_lens_cpu=tuple(query_lens.tolist()),
            seq_lens_cpu=tuple(seq_lens.tolist()),
            decode_query_len=query_len,
        )
        return FlatBatch(
            chunks=chunks or [],
            input_ids=ids_d,
            positions=pos_d,
            meta=meta,
            logits_indices=rows_d,
            sampling_chunks=sampling_chunks or [],
            is_decode_only=step.is_decode_only,
            host=step,
        )

    def _host_arrays(
        self, ordered: list[ScheduledChunk], num_rows: int, pad_query_len: int
    ) -> _HostArrays:
        """The step's per-token and per-row numpy arrays; rows past `ordered` are padding
        (`pad_query_len` tokens each)."""
        num_real = len(ordered)
        query_lens = np.full(num_rows, pad_query_len, np.int64)
        query_lens[:num_real] = [c.num_new_tokens for c in ordered]
        start_pos = np.zeros(num_rows, np.int64)
        start_pos[:num_real] = [c.start_pos for c in ordered]
        seq_lens = start_pos + query_lens
        cu_q = np.zeros(num_rows + 1, np.int64)
        np.cumsum(query_lens, out=cu_q[1:])
        num_tokens = int(cu_q[-1])
        token_req = np.repeat(np.arange(num_rows), query_lens)  # [T] request of each token
        positions = np.arange(num_tokens) - cu_q[:-1][token_req] + start_pos[token_req]
        block_tables = self._block_tables(ordered, seq_lens, num_rows)
        bs = self.block_size
        slot_mapping = block_tables[token_req, positions // bs] * bs + positions % bs
        input_ids = np.zeros(num_tokens, np.int64)
        if num_real:
            input_ids[: cu_q[num_real]] = np.concatenate([c.token_ids for c in ordered])
        return _HostArrays(
            query_lens, seq_lens, cu_q, positions, slot_mapping, input_ids, block_tables
        )

    def _block_tables(
        self, ordered: list[ScheduledChunk], seq_lens: np.ndarray, num_rows: int
    ) -> np.ndarray:  # [num_rows, widest] int64; padded rows point at the scratch block
        bs = self.block_size
        num_blocks = (seq_lens + bs - 1) // bs
        block_tables = np.zeros((num_rows, int(num_blocks.max())), np.int64)
        for i, c in enumerate(ordered):
            n = int(num_blocks[i])
            block_tables[i, :n] = c.block_ids[:n]
        block_tables[len(ordered) :] = self.scratch_block
        return block_tables

    def _to_device(self, fields: Sequence[np.ndarray]) -> list[torch.Tensor]:
        """One host buffer, one copy; flat device views of each field, in order."""
        sizes = [a.size for a in fields]
        total = sum(sizes)
        if self._copied is not None and not self._copied.query():
            self._copied.synchronize()  # the previous copy out of _host must finish first
        if self._host.numel() < total:
            capacity = max(total, 2 * self._host.numel(), 4096)
            self._host = torch.empty(capacity, dtype=torch.int64, pin_memory=self._pin)
            self._dev = torch.empty(capacity, dtype=torch.int64, device=self.device)
        host = self._host.numpy()
        offset = 0
        for a, n in zip(fields, sizes):
            host[offset : offset + n] = a.reshape(-1)
            offset += n
        if self.device.type == "cpu":
            flat = self._host[:total].clone()  # the next step reuses the host buffer
        else:
            flat = self._dev[:total]
            flat.copy_(self._host[:total], non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        return list(flat.split(sizes))


def verify_query_len(ordered: Sequence[ScheduledChunk]) -> int:
    """Q when every chunk is a speculative verify of Q tokens (the last token and Q - 1
    drafts): the batch's rows are then all decodes of Q queries (`decode_query_len`, the
    backends' decode path, a verify graph); else 1 (a verify chunk among others attends as a
    prompt chunk does)."""
    if not ordered or not all(c.num_draft_tokens and not c.is_prefill for c in ordered):
        return 1
    lengths = {c.num_new_tokens for c in ordered}
    return lengths.pop() if len(lengths) == 1 else 1


def _logits_rows(
    ordered: Sequence[ScheduledChunk], sampling_rows: list[int], cu_q: np.ndarray
) -> np.ndarray:
    """[num sampled rows] the token rows the sampler reads: a sampling chunk's last token, a
    verify chunk's every token (its last token and each draft), in chunk order."""
    counts = np.array([ordered[i].num_sampled_rows for i in sampling_rows], np.int64)
    ends = cu_q[1:][sampling_rows]  # one past each sampling chunk's last token
    return np.repeat(ends - np.cumsum(counts), counts) + np.arange(int(counts.sum()))


def _pending_rows(
    ordered: Sequence[ScheduledChunk], prev: DeviceTokens | None
) -> tuple[np.ndarray, np.ndarray]:
    """(token rows of the `PENDING` decodes, their rows in `prev.token_ids`). Decodes lead the
    batch with one token each, so decode row i is token i."""
    pending = [i for i, c in enumerate(ordered) if c.token_ids[0] == PENDING]
    if not pending:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    if prev is None:
        raise ValueError("a PENDING decode needs the previous step's device tokens")
    src = [prev.rows[ordered[i].request] for i in pending]
    return np.array(pending, np.int64), np.array(src, np.int64)
