"""`KVReservations`: the decode role's blocks reserved for incoming KV, by request (a part
`EngineCore` owns).

```
reserve(request_id, num_tokens)       fresh blocks for the whole prompt
reserve_prefix(request, num_tokens)   the prompt's longest cached prefix (either tier; the hits
                                      referenced at once, so nothing evicts them before use)
                                      + fresh blocks for the rest: the sender sends only those
admit(request, block_ids)             add_prefilled: the blocks go to the request (its cached
                                      prefix counted as a prefix hit, its blocks hashed already)
release(request_id)                   abort: every block freed (hits back to the cache)
detach(request_id)                    out of the ledger, not freed (a KV writer may still land)
```

After each reservation `settle` runs (the host tier's copies that touch a block handed out
are done before a KV transfer writes it, on no stream of ours).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from engine.kv_cache_manager import KVCacheManager
from engine.request import Request
from pdserve.sampling_params import InvalidRequestError


class PrefixReservation(NamedTuple):
    """Blocks reserved for a request's incoming KV."""

    block_ids: list[int]  # every block, the cached ones first; each referenced once
    num_cached_blocks: int  # leading blocks that hold the prompt's KV already (prefix hits)
    num_promoted_blocks: int  # of those, found in the host tier (promoted)


class NoFreeBlocksError(RuntimeError):
    """The KV pool cannot hold the tokens asked for right now (retry later or elsewhere)."""


class KVReservations:
    def __init__(self, kv: KVCacheManager, settle: Callable[[], None] | None = None) -> None:
        self._kv = kv
        self._settle = settle
        self._reserved: dict[str, PrefixReservation] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._reserved

    def __len__(self) -> int:
        return len(self._reserved)

    def ids(self) -> list[str]:
        return sorted(self._reserved)

    def reserve(self, request_id: str, num_tokens: int) -> PrefixReservation:
        """Fresh blocks for `num_tokens` tokens; NoFreeBlocksError when the pool is short."""
        block_ids = self._kv.reserve(num_tokens)
        if block_ids is None:
            raise self._short(num_tokens)
        return self._keep(request_id, PrefixReservation(block_ids, 0, 0))

    def reserve_prefix(self, request: Request, num_tokens: int) -> PrefixReservation:
        """Blocks for `num_tokens` tokens of `request`, its cached prefix first."""
        hit_ids, num_promoted = self._kv.hold_prefix(request)  # held first: never evicted
        num_new_tokens = num_tokens - len(hit_ids) * self._kv.block_size
        new_ids = self._kv.reserve(num_new_tokens) if num_new_tokens > 0 else None
        if new_ids is None:
            self._kv.free_blocks(hit_ids)
            if num_new_tokens <= 0:  # the sender must send some: a hit leaves a token out
                raise ValueError(f"{num_tokens} tokens are fewer than the prompt's cached ones")
            raise self._short(num_tokens)
        reserved = PrefixReservation(hit_ids + new_ids, len(hit_ids), num_promoted)
        return self._keep(request.request_id, reserved)

    def admit(self, request: Request, block_ids: Sequence[int]) -> None:
        """Hand `request` its reserved blocks (InvalidRequestError, nothing changed, unless
        `block_ids` are exactly those)."""
        reserved = self._reserved.get(request.request_id)
        if reserved is None or list(block_ids) != reserved.block_ids:
            raise InvalidRequestError(
                f"request {request.request_id!r}: block ids were not reserved for it"
            )
        del self._reserved[request.request_id]
        request.block_ids = list(block_ids)
        self._kv.admit_prefix(request, reserved.num_cached_blocks, reserved.num_promoted_blocks)

    def release(self, request_id: str) -> bool:
        """Free the request's reserved blocks; False when it has none."""
        reserved = self._reserved.pop(request_id, None)
        if reserved is None:
            return False
        self._kv.free_blocks(reserved.block_ids)
        return True

    def detach(self, request_id: str) -> list[int]:
        """The request's reserved blocks, out of the ledger and not freed ([] if none)."""
        reserved = self._reserved.pop(request_id, None)
        return reserved.block_ids if reserved is not None else []

    def _keep(self, request_id: str, reserved: PrefixReservation) -> PrefixReservation:
        if self._settle is not None:
            self._settle()  # no host-tier copy still touches these blocks
        self._reserved[request_id] = reserved
        return reserved

    def _short(self, num_tokens: int) -> NoFreeBlocksError:
        return NoFreeBlocksError(
            f"no room for {num_tokens} tokens of KV ({self._kv.num_free_blocks} free blocks)"
        )
