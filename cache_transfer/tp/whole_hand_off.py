"""`WholeHandOff`: one tensor-parallel hand-off as its node sees it, one session; the part that
a `FanOutSender` (a prefill rank) and a `TPReceiver` (decode rank 0) each own.

```
group                    the SessionGroup over this rank's parts (its routes, or a fan-in)
add_remote(part)         another rank's share (its report carried by the node: node_common/tp/)
seal()                   every share joined: the group may succeed
remote_bytes             the KV bytes the other ranks reported moving
state, error, finished, elapsed_s, wait(), abort(), cancel(), add_finish_callback(cb)
                         the group's: what the node reads of the owner, as of one session
```
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from cache_transfer.state import TransferState
from cache_transfer.tp.session_group import RemotePart, SessionGroup

Owner = TypeVar("Owner")


class WholeHandOff(Generic[Owner]):
    def __init__(self, owner: Owner, transfer_id: str, timeout_s: float) -> None:
        """`owner`: what finish callbacks receive; `timeout_s`: the group's deadline."""
        self.group = SessionGroup(transfer_id, timeout_s)
        self.remote: list[RemotePart] = []
        self._owner = owner

    def add_remote(self, part: RemotePart) -> None:
        """Another rank's share; `seal` once every rank's joined."""
        self.remote.append(part)
        self.group.add(part)

    def seal(self) -> None:
        self.group.seal()

    @property
    def remote_bytes(self) -> int:
        return sum(p.num_bytes for p in self.remote)

    @property
    def state(self) -> TransferState:
        return self.group.state

    @property
    def error(self) -> str | None:
        return self.group.error

    @property
    def finished(self) -> bool:
        return self.group.finished

    @property
    def elapsed_s(self) -> float:
        return self.group.elapsed_s

    def add_finish_callback(self, callback: Callable[[Owner], None]) -> None:
        self.group.add_finish_callback(lambda _: callback(self._owner))

    def abort(self, reason: str) -> None:
        self.group.abort(reason)

    def cancel(self, reason: str) -> None:
        self.group.cancel(reason)

    async def wait(self) -> TransferState:
        return await self.group.wait()
