"""`StagingPool`: reusable flat uint8 buffers that packed layers travel in, shared by a node's
sessions.

Fresh host memory costs a page fault per 4 KiB on first touch (often slower than the network),
and pinned or transport-registered memory is costly to allocate, so buffers outlive sessions.
They come in power-of-two size classes, so requests of different lengths reuse each other's
memory; at most `max_idle_bytes` are kept while idle.
"""

from __future__ import annotations

import torch

from cache_transfer.packing.packed_layer import LayerSource, alloc_staging

MIN_CLASS_BYTES = 64 << 10


class StagingPool:
    def __init__(self, max_idle_bytes: int = 512 << 20) -> None:
        if max_idle_bytes < 0:
            raise ValueError(f"max_idle_bytes must be >= 0, got {max_idle_bytes}")
        self.max_idle_bytes = max_idle_bytes
        self.idle_bytes = 0
        self._free: dict[tuple[torch.device, int], list[torch.Tensor]] = {}
        self._lent: dict[int, torch.Tensor] = {}  # data_ptr -> whole buffer

    @property
    def num_lent(self) -> int:
        return len(self._lent)

    def take(self, num_bytes: int, device: torch.device) -> torch.Tensor:
        """A `[num_bytes]` uint8 view of a pooled buffer on `device`; hand it back with
        `give_back`, or `discard` it if something else may still use its memory."""
        if num_bytes <= 0:
            raise ValueError(f"num_bytes must be > 0, got {num_bytes}")
        size_class = max(MIN_CLASS_BYTES, 1 << (num_bytes - 1).bit_length())
        free = self._free.get((torch.device(device), size_class))
        if free:
            buffer = free.pop()
            self.idle_bytes -= size_class
        else:
            buffer = alloc_staging(size_class, device)
        self._lent[buffer.data_ptr()] = buffer
        return buffer[:num_bytes]

    def give_back(self, view: torch.Tensor) -> None:
        """Return a buffer from `take` for reuse (dropped if the pool is full)."""
        buffer = self._lent.pop(view.data_ptr())
        if self.idle_bytes + buffer.numel() <= self.max_idle_bytes:
            self._free.setdefault((buffer.device, buffer.numel()), []).append(buffer)
            self.idle_bytes += buffer.numel()

    def discard(self, view: torch.Tensor) -> None:
        """Forget a buffer from `take` without reusing it (a transport may still read it)."""
        self._lent.pop(view.data_ptr(), None)


class StagedSend:
    """The staging of one send: each layer's payload is its source itself (packed bytes
    where the transport sends from) or a pooled buffer the source fills. `release(sent)`
    gives the buffers back once the transport released them, or discards them if it may
    still read them (the send failed or was cancelled)."""

    def __init__(self, pool: StagingPool, device: torch.device) -> None:
        self._pool = pool
        self._device = device
        self._taken: list[torch.Tensor] = []

    def payload(self, source: LayerSource, num_bytes: int) -> torch.Tensor:
        if isinstance(source, torch.Tensor):
            return source
        self._taken.append(self._pool.take(num_bytes, self._device))
        source(self._taken[-1])
        return self._taken[-1]

    def release(self, sent: bool) -> None:
        for buffer in self._taken:
            if sent:
                self._pool.give_back(buffer)
            else:  # the transport may still be reading it
                self._pool.discard(buffer)
        self._taken.clear()
