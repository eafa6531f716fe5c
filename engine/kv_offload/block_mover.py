"""`KVBlockMover`: runs the host tier's `OffloadCommands` between one device KV pool and its
host pool. One per process that holds a pool (with tensor parallelism, one per rank, each on
its own slice of every block, all given the same commands).

    run(commands)   demotions, then promotions: each one batched copy over every layer's K
                    and V (on CUDA one Triton launch, `kernels.kv_copy.copy_blocks_layers`,
                    reading or writing the host pool through its CUDA view), queued on a side
                    stream after the work already queued on the current one; one event per
                    round. The current stream waits for a round with promotions (the step
                    reads them) and for `guard_seq` (a block it writes was being copied).
    wait_on_host(seq)   the caller waits for round `seq` (a block handed to a KV writer that
                    is no stream of this process: a transfer)

On CPU the same two copies run at once, block by block (a strided copy each).
Copies move raw words (int64 where the rows allow it), so any KV dtype travels bit for bit.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import torch

from engine.host_copy import on_device
from engine.kv_cache_pool import KVCachePool
from engine.kv_offload.host_kv_pool import HostKVPool
from engine.kv_offload.offload_commands import OffloadCommands
from kernels.kv_copy import copy_blocks_layers, layers_table, triton_available

RowPair = tuple[torch.Tensor, torch.Tensor]


class KVBlockMover:
    def __init__(self, device_pool: KVCachePool, host_pool: HostKVPool) -> None:
        self.device = device_pool.buffer.device
        self.bytes_per_block = device_pool.bytes_per_block
        self.num_demoted_bytes = 0
        self.num_promoted_bytes = 0
        self._device_words = as_words(device_pool.buffer)  # [layers, 2, blocks, row_words]
        self._host_words = as_words(host_pool.device_view)
        self._stream: torch.cuda.Stream | None = None
        self._events: deque[tuple[int, torch.cuda.Event]] = deque()  # rounds not known done
        self._device_rows = _rows(self._device_words)
        self._host_rows = _rows(self._host_words)
        self._to_host: torch.Tensor | None = None  # layers_table: one launch for all layers
        self._to_device: torch.Tensor | None = None
        if self.device.type == "cuda":
            self._stream = torch.cuda.Stream(self.device)
            if triton_available():
                self._to_host = layers_table(self._device_rows, self._host_rows)
                self._to_device = layers_table(self._host_rows, self._device_rows)

    def run(self, commands: OffloadCommands) -> None:
        """Queue `commands`' copies; make the current stream wait where it must."""
        if commands.num_copies:
            if self._stream is None:
                self._copy_all(commands)
            else:
                self._issue(commands)
        if commands.guard_seq:
            self._wait(commands.guard_seq, on_host=False)

    def wait_on_host(self, seq: int) -> None:
        """Block until round `seq`'s copies are done (nothing to wait for on CPU)."""
        if seq:
            self._wait(seq, on_host=True)

    def warm_up(self) -> None:
        """Compile the copy kernel before serving (Triton specializes a block count of 1 and
        multiples of 16): copies between blocks nothing holds yet, waited for."""
        if self._to_host is None:
            return
        num_blocks = min(self._device_words.shape[2], self._host_words.shape[2])
        for n in (1, 2, 16):
            if n <= num_blocks:
                ids = tuple(range(n))
                self._copy(self._device_words, ids, self._host_words, ids, self._to_host)
        torch.cuda.synchronize(self.device)

    def synchronize(self) -> None:
        """Block until every queued copy is done (benchmarks, tests)."""
        if self._stream is not None:
            self._stream.synchronize()
            self._events.clear()

    def _issue(self, commands: OffloadCommands) -> None:
        assert self._stream is not None
        current = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(current)  # blocks' earlier writes first, whatever freed them
        with torch.cuda.stream(self._stream):
            self._copy_all(commands)
            event = torch.cuda.Event()
            event.record(self._stream)
        self._events.append((commands.seq, event))
        if commands.promote_src:
            current.wait_event(event)  # the step reads the promoted blocks

    def _copy_all(self, commands: OffloadCommands) -> None:
        if commands.demote_src:
            self._copy(self._device_words, commands.demote_src, self._host_words,
                       commands.demote_dst, self._to_host)  # fmt: skip
            self.num_demoted_bytes += len(commands.demote_src) * self.bytes_per_block
        if commands.promote_src:
            self._copy(self._host_words, commands.promote_src, self._device_words,
                       commands.promote_dst, self._to_device)  # fmt: skip
            self.num_promoted_bytes += len(commands.promote_src) * self.bytes_per_block

    def _copy(
        self,
        src: torch.Tensor,
        src_ids: Sequence[int],
        dst: torch.Tensor,
        dst_ids: Sequence[int],
        table: torch.Tensor | None,
    ) -> None:
        """dst blocks `dst_ids` = src blocks `src_ids`, every layer, K and V, in one batch
        (on CPU block by block: a strided copy of a block ran 4-19x faster than index_select
        plus index_copy_ along the block dimension of these pools)."""
        if self._stream is None:
            for src_id, dst_id in zip(src_ids, dst_ids, strict=True):
                dst[:, :, dst_id].copy_(src[:, :, src_id])
            return
        src_index = on_device(list(src_ids), self.device, torch.int64)
        dst_index = on_device(list(dst_ids), self.device, torch.int64)
        if table is None:  # rows the kernel cannot take (alignment): two torch launches
            dst.index_copy_(2, dst_index, src.index_select(2, src_index))
            return
        src_rows, dst_rows = (
            (self._device_rows, self._host_rows)
            if src is self._device_words
            else (self._host_rows, self._device_rows)
        )
        copy_blocks_layers(src_rows, src_index, dst_rows, dst_index, table)

    def _wait(self, seq: int, on_host: bool) -> None:
        while self._events and self._events[0][1].query():
            self._events.popleft()  # done: nothing waits for these again
        for event_seq, event in self._events:
            if event_seq == seq:
                if on_host:
                    event.synchronize()
                else:
                    torch.cuda.current_stream(self.device).wait_event(event)
                return


def as_words(buffer: torch.Tensor) -> torch.Tensor:
    """`[layers, 2, blocks, block_size, heads, head_dim]` as `[layers, 2, blocks, row_words]`
    of the widest integer type a block row is a whole number of (int64 for real models)."""
    layers, kv, num_blocks = buffer.shape[:3]
    rows = buffer.reshape(layers, kv, num_blocks, -1)
    row_bytes = rows.shape[-1] * rows.element_size()
    for word in (torch.int64, torch.int32, torch.int16):
        if row_bytes % word.itemsize == 0:
            return rows.view(word)
    return rows.view(torch.uint8)


def _rows(words: torch.Tensor) -> list[RowPair]:
    """Each layer's K rows and V rows, `[blocks, row_words]` views (the copy kernel's rows)."""
    return [(words[layer, 0], words[layer, 1]) for layer in range(words.shape[0])]
