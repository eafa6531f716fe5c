"""What rank 0 and the other ranks of a tensor-parallel node tell each other over their
`RankLink` (node_common/tp/rank_link.py): plain, picklable records.

```
rank 0 ──► rank r                              rank r ──► rank 0
OpenFanIn     decode: take this hand-off's     Done   its share of a hand-off ended (ok, or
              routes into your pool (call)            why not; bytes moved): a decode rank
SendKV        prefill: send this request's            reports once nothing of it writes into
              KV on the routes leaving you            the blocks any more
Abort         end a hand-off (its peers told)
CloseRequest  prefill: forget a request (its prefill call ended)
RankStats     what you hold (call; leak checks, GetStats)  ─► RankReport
Shutdown      end every hand-off, close your transport (call; the node stops)
```
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OpenFanIn:
    ticket: bytes  # the decode node's signed TransferTicket, serialized
    timeout_s: float  # no progress
    max_ceiling_s: float | None  # the senders' ceiling, at most
    request_id: str = ""  # (log lines)


@dataclass(frozen=True)
class SendKV:
    request_id: str
    ticket: bytes  # serialized TransferTicket (the rank checks its signature itself)
    timeout_s: float  # no progress
    ceiling_s: float | None  # from now (the prompts queued ahead counted on rank 0)


@dataclass(frozen=True)
class Abort:
    transfer_id: str
    reason: str


@dataclass(frozen=True)
class CloseRequest:
    request_id: str
    reason: str


@dataclass(frozen=True)
class Done:
    transfer_id: str
    ok: bool
    error: str
    num_bytes: int


@dataclass(frozen=True)
class RankStats:
    pass


@dataclass(frozen=True)
class RankReport:
    rank: int
    num_pending_transfers: int  # route sessions live on the rank's transfer manager
    num_open_hand_offs: int  # fan-ins / fan-outs not yet reported done
    num_open_requests: int  # prefill: requests whose layers the rank still keeps


@dataclass(frozen=True)
class Shutdown:
    reason: str
