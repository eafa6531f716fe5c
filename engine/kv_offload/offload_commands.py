"""`OffloadCommands`: one round of the host tier's block copies, as plain block ids.

Rank 0's `HostBlockManager` (the ledger) makes them; every rank's `KVBlockMover` runs them on
its own device and host pools (tensor parallelism: each rank holds its slice of every block
under the same ids), before the step that follows them writes or reads any of those blocks.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OffloadCommands:
    """Run in this order: every demotion (device block -> host block), then every promotion
    (host block -> device block); each list one batched copy. A round is the time between two
    flushes (step launches, or a reservation that reuses a block still being copied)."""

    seq: int  # this round's number, 1, 2, ...: its copies' completion is tracked under it
    demote_src: tuple[int, ...] = ()  # device block ids
    demote_dst: tuple[int, ...] = ()  # host block ids, distinct
    promote_src: tuple[int, ...] = ()  # host block ids
    promote_dst: tuple[int, ...] = ()  # device block ids, distinct
    # The latest round whose copies touch a device block handed out again since the last
    # flush: they must finish before anything writes that block (0: none).
    guard_seq: int = 0

    @property
    def num_copies(self) -> int:
        return len(self.demote_src) + len(self.promote_src)
