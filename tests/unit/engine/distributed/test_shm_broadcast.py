"""The step broadcast through shared memory (engine/distributed/shm_broadcast.py) and the step
message it carries (step_message.py)."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from engine.distributed.shm_broadcast import ShmBroadcast
from engine.distributed.step_message import STOP, StepMessage


def _reader(end: ShmBroadcast, into: list[StepMessage]) -> threading.Thread:
    def run() -> None:
        while (message := StepMessage.decode(end.read())) is not None:
            into.append(message)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_messages_of_any_size_arrive_whole_and_in_order() -> None:
    writer = ShmBroadcast.create(2, num_slots=2, slot_bytes=64)  # most messages span slots
    readers = [ShmBroadcast.attach(writer.path, 2, r, num_slots=2, slot_bytes=64) for r in (0, 1)]
    writer.unlink()  # attached: the mappings stay, the file is gone
    assert not os.path.exists(writer.path)
    received: list[list[StepMessage]] = [[], []]
    threads = [_reader(end, into) for end, into in zip(readers, received)]
    sent = [
        StepMessage(
            (i, i % 2, 7), (np.arange(i * 13), np.arange(3) - i), {"chunk": i} if i % 3 else None
        )
        for i in range(40)
    ]
    for message in sent:
        writer.write(message.encode(), timeout_s=30.0)
    writer.write(STOP, timeout_s=30.0)
    for thread in threads:
        thread.join(timeout=30)
        assert not thread.is_alive()
    for got in received:
        assert [m.ints for m in got] == [m.ints for m in sent]
        assert [m.extras for m in got] == [m.extras for m in sent]
        for a, b in zip(sent, got):
            assert all(np.array_equal(x, y) for x, y in zip(a.arrays, b.arrays))
    for end in (writer, *readers):
        end.close()


def test_a_reader_that_takes_nothing_times_the_writer_out() -> None:
    writer = ShmBroadcast.create(1, num_slots=2, slot_bytes=256)  # a message per slot
    reader = ShmBroadcast.attach(writer.path, 1, 0, num_slots=2, slot_bytes=256)
    writer.unlink()
    message = StepMessage((1,), (np.arange(4),)).encode()
    writer.write(message, timeout_s=1.0)
    writer.write(message, timeout_s=1.0)  # both slots full now: nobody read
    checks: list[int] = []
    with pytest.raises(TimeoutError):
        writer.write(message, timeout_s=0.3, check=lambda: checks.append(1))
    assert checks, "the writer checks the readers while it waits"

    def dead() -> None:
        raise RuntimeError("rank 1 died")

    with pytest.raises(RuntimeError, match="rank 1 died"):
        writer.write(message, timeout_s=5.0, check=dead)
    reader.close()
    writer.close()
