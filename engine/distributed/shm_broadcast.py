"""`ShmBroadcast`: rank 0 hands each step's message to the other ranks through shared memory.

```
file in /dev/shm (mapped by every rank; rank 0 unlinks it once all attached, so nothing is
left behind whatever happens to the processes)
  [reader acks: u64 x num_readers]   the last chunk each reader took
  slot 0..S-1: [seq u64][nbytes u64][last u64][pad u64][payload: slot_bytes]
write(buffers)   the message cut into chunks; chunk n goes to slot n % S once every reader
                 took chunk n - S; payload, nbytes, last, then seq (the reader's signal)
read()           wait for slot's seq == the next chunk's, copy it out, ack; until `last`
```

One writer (rank 0), a fixed set of readers; any message size (large ones span slots). The
writer waits only when a reader is S chunks behind (bounded by `timeout_s`, checking the
readers are alive meanwhile); a reader waits for the next step as long as it takes, spinning
(sched_yield) for a short while, then sleeping in growing steps, so an idle engine costs no
CPU. A lock round trip is the memory fence between the payload and the seq (a no-op on x86,
needed on weaker memory models). Linux only (/dev/shm).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

import numpy as np

_SLOT_HEADER = 32  # seq, nbytes, last, pad
_SPIN_S = 0.002  # a reader spins this long before it sleeps
_SLEEP_S = (5e-5, 1e-3)  # then sleeps from the first to the second, doubling
_SHM_DIR = Path("/dev/shm")


class ShmBroadcast:
    def __init__(
        self,
        path: str,
        num_readers: int,
        *,
        reader: int | None,
        num_slots: int = 4,
        slot_bytes: int = 1 << 20,
        create: bool = False,
    ) -> None:
        """`reader`: this process's reader index, None for the writer. Use `create` /
        `attach`."""
        self.path = path
        self.num_readers = num_readers
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.reader = reader
        self._acks_bytes = -(-8 * num_readers // 64) * 64
        size = self._acks_bytes + num_slots * (_SLOT_HEADER + slot_bytes)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            self._mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._buf = memoryview(self._mm)
        self._acks = np.frombuffer(self._mm, np.uint64, num_readers, 0)
        self._next = 1  # the next chunk's sequence number (written or read)
        self._fence_lock = threading.Lock()

    @classmethod
    def create(
        cls, num_readers: int, num_slots: int = 4, slot_bytes: int = 1 << 20
    ) -> ShmBroadcast:
        """The writer's end, in a new file (its path goes to the readers)."""
        folder = _SHM_DIR if _SHM_DIR.is_dir() else Path(tempfile.gettempdir())
        path = folder / f"pdserve-tp-{os.getpid()}-{secrets.token_hex(6)}"
        return cls(str(path), num_readers, reader=None, num_slots=num_slots,
                   slot_bytes=slot_bytes, create=True)  # fmt: skip

    @classmethod
    def attach(
        cls, path: str, num_readers: int, reader: int, num_slots: int = 4, slot_bytes: int = 1 << 20
    ) -> ShmBroadcast:
        return cls(path, num_readers, reader=reader, num_slots=num_slots, slot_bytes=slot_bytes)

    def unlink(self) -> None:
        """Remove the file (every rank attached keeps its mapping)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def close(self) -> None:
        self._acks = np.empty(0, np.uint64)
        self._buf.release()
        with contextlib.suppress(BufferError):  # a view still alive: the mapping goes with it
            self._mm.close()

    def _fence(self) -> None:
        with self._fence_lock:
            pass

    def _slot(self, seq: int) -> tuple[np.ndarray, int]:
        """(the slot's header [seq, nbytes, last], the payload's offset) of chunk `seq`."""
        start = self._acks_bytes + (seq - 1) % self.num_slots * (_SLOT_HEADER + self.slot_bytes)
        return np.frombuffer(self._mm, np.uint64, 3, start), start + _SLOT_HEADER

    def write(
        self,
        buffers: Sequence[memoryview],
        timeout_s: float,
        check: Callable[[], None] | None = None,
    ) -> None:
        """Send the concatenation of `buffers` (byte views) as one message. Waits at most
        `timeout_s` for a slow reader (TimeoutError), calling `check` while it waits."""
        chunks = _chunks(buffers, self.slot_bytes)
        for i, pieces in enumerate(chunks):
            seq = self._next
            if seq > self.num_slots:
                free = seq - self.num_slots  # every reader must have taken this chunk
                _wait(partial(_at_least, self._acks, free), timeout_s, check)
            header, offset = self._slot(seq)
            for piece in pieces:
                self._buf[offset : offset + piece.nbytes] = piece
                offset += piece.nbytes
            header[1] = sum(p.nbytes for p in pieces)
            header[2] = int(i == len(chunks) - 1)
            self._fence()
            header[0] = seq
            self._next += 1

    def read(self) -> bytearray:
        """The next message (blocks until it comes)."""
        assert self.reader is not None, "the writer does not read"
        out = bytearray()
        while True:
            seq = self._next
            header, offset = self._slot(seq)
            _wait(partial(_at_least, header[:1], seq), None, None)
            self._fence()
            nbytes, last = int(header[1]), int(header[2])
            out += self._buf[offset : offset + nbytes]
            self._fence()
            self._acks[self.reader] = seq
            self._next += 1
            if last:
                return out


def _at_least(values: np.ndarray, seq: int) -> bool:
    """Whether every value (acks; a slot's seq) reached `seq`."""
    return int(values.min()) >= seq


def _chunks(buffers: Sequence[memoryview], slot_bytes: int) -> list[list[memoryview]]:
    """The message's bytes cut into slot-sized chunks (pieces of the buffers; at least one)."""
    chunks: list[list[memoryview]] = [[]]
    room = slot_bytes
    for buf in buffers:
        flat = buf.cast("B") if buf.format != "B" or buf.ndim != 1 else buf
        while flat.nbytes:
            if room == 0:
                chunks.append([])
                room = slot_bytes
            piece, flat = flat[:room], flat[room:]
            chunks[-1].append(piece)
            room -= piece.nbytes
    return chunks


def _wait(
    ready: Callable[[], bool], timeout_s: float | None, check: Callable[[], None] | None
) -> None:
    if ready():
        return
    start = time.monotonic()
    sleep_s = _SLEEP_S[0]
    while not ready():
        now = time.monotonic()
        if now - start < _SPIN_S:
            os.sched_yield()
            continue
        if timeout_s is not None and now - start > timeout_s:
            raise TimeoutError(f"no room in the step broadcast for {timeout_s:.0f} s")
        if check is not None:
            check()
        time.sleep(sleep_s)
        sleep_s = min(2 * sleep_s, _SLEEP_S[1])
