"""`LiveSessions`: a transfer manager's sessions by transfer id, from creation to their end;
the manager owns one.

    check_new(id), add_receiver / add_sender(session)
                                  a new session joins its table (receivers, senders) until it
                                  finishes (one that failed at creation is only counted)
    its end                       counted: num_succeeded (num_in_place of them; bytes moved and
                                  skipped) or num_failed,
                                  unless `retire` ended it unused; a receiver's end is
                                  remembered (FinishedReceivers: late hellos refused), and one
                                  whose writes in place are not settled stays `quarantined`
                                  (its sender's drained notice still reaches it) until they are
"""

from __future__ import annotations

import asyncio
import logging
from typing import TypeVar

from cache_transfer.finished_receivers import FinishedReceivers
from cache_transfer.receiver import KVReceiver
from cache_transfer.sender import KVSender
from cache_transfer.state import TransferState

S = TypeVar("S", KVReceiver, KVSender)


class LiveSessions:
    def __init__(self, finished: FinishedReceivers) -> None:
        """`finished`: where receivers that ended are remembered."""
        self.receivers: dict[str, KVReceiver] = {}
        self.senders: dict[str, KVSender] = {}
        # failed receivers granted in place, until their sender's writes are settled
        self.quarantined: dict[str, KVReceiver] = {}
        self.num_succeeded = self.num_failed = 0
        self.num_in_place = 0  # of num_succeeded: written in place
        self.num_bytes_moved = self.num_bytes_skipped = 0  # successful hand-offs': moved, held
        self._finished = finished
        self._retired: set[str] = set()  # receivers ended unused (not counted)
        self._background: set[asyncio.Task[None]] = set()

    def __len__(self) -> int:
        return len(self.receivers) + len(self.senders)

    def all(self) -> list[KVReceiver | KVSender]:
        return [*self.receivers.values(), *self.senders.values()]

    def get(self, transfer_id: str) -> KVReceiver | KVSender | None:
        return self.receivers.get(transfer_id) or self.senders.get(transfer_id)

    def check_new(self, transfer_id: str) -> None:
        if self.get(transfer_id) is not None:
            raise ValueError(f"transfer {transfer_id!r} is already in progress on this node")

    def add_receiver(self, receiver: KVReceiver) -> KVReceiver:
        return self._add(receiver, self.receivers)

    def add_sender(self, sender: KVSender) -> KVSender:
        return self._add(sender, self.senders)

    def retire(self, receiver: KVReceiver, reason: str) -> None:
        """End a receiver no sender used (the hand-off went another way): not counted, not told."""
        if self.receivers.get(receiver.transfer_id) is receiver and receiver.sender_id is None:
            self._retired.add(receiver.transfer_id)
            receiver.fail(f"retired: {reason}", notify_peer=False, level=logging.INFO)

    def _add(self, session: S, table: dict[str, S]) -> S:
        if session.finished:
            self._count(session)
            return session
        table[session.transfer_id] = session
        session.add_finish_callback(lambda _: self._on_finish(session, table))
        return session

    def _on_finish(self, session: S, table: dict[str, S]) -> None:
        table.pop(session.transfer_id, None)
        if session.transfer_id in self._retired:
            self._retired.discard(session.transfer_id)
            return
        self._count(session)
        if isinstance(session, KVReceiver):
            if not session.writes_settled.is_set():
                self._quarantine(session)
            why = session.error or session.state.name
            self._finished.remember(session, why)

    def _quarantine(self, receiver: KVReceiver) -> None:
        """Keep routing its sender's drained notice to it until its writes are settled."""
        self.quarantined[receiver.transfer_id] = receiver

        async def settled() -> None:
            await receiver.writes_settled.wait()  # bounded: the receiver's quarantine timer
            self.quarantined.pop(receiver.transfer_id, None)

        task = asyncio.get_running_loop().create_task(settled())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _count(self, session: KVReceiver | KVSender) -> None:
        if session.state == TransferState.SUCCESS:
            self.num_succeeded += 1
            self.num_in_place += session.in_place
            if isinstance(session, KVReceiver):
                self.num_bytes_moved += session.num_bytes_received
            else:
                self.num_bytes_moved += session.num_bytes_sent
            self.num_bytes_skipped += session.num_bytes_skipped
        else:
            self.num_failed += 1
