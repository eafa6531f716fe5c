"""`TransferState`: where one KV hand-off stands, ordered so progress compares with `<`."""

from __future__ import annotations

import enum


class TransferState(enum.IntEnum):
    FAILED = 0  # refused, timed out, aborted or lost: final
    BOOTSTRAPPING = 1  # sender: handshake sent, not acked; receiver: waiting for the handshake
    WAITING = 2  # handshake accepted; no layer has moved yet
    TRANSFERRING = 3  # at least one layer sent (sender) or landed (receiver)
    SUCCESS = 4  # every layer and the first token are in place on the receiver: final

    @property
    def finished(self) -> bool:
        return self in (TransferState.FAILED, TransferState.SUCCESS)
