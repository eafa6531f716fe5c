"""`TPComm`: one engine's tensor-parallel process group and the collectives it runs.

```
rank 0   TPStore: a torch TCPStore on 127.0.0.1, port 0 (the OS picks a free one)
ranks    init_process_group(NCCL on CUDA, gloo on CPU, store, timeout) -> the default group
model    all_reduce (after o_proj and down_proj, after the vocab-parallel embedding lookup),
         gather_to_first (the LM head's vocab slices, to rank 0's sampler)
engine   broadcast (async scheduling: the previous step's sampled ids, rank 0's device tensor),
         min_int (the KV pool size every rank can hold), barrier (start)
```

Every collective runs under the group's timeout: a rank that hangs is detected by it (gloo
raises; NCCL's watchdog aborts). A failure (a peer gone, a timeout) is raised as `TPError`,
through `diagnose`, which names the rank that died when the worker watcher knows it. One
tensor-parallel engine per process (torch.distributed's default group is process-wide).
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"


class TPError(RuntimeError):
    """A tensor-parallel rank died, hung or failed: the engine cannot go on."""


def _plain_error(error: BaseException) -> TPError:
    return TPError(f"a tensor-parallel collective failed: {error}")


def create_store(world_size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0's rendezvous store on a free loopback port (`store.port`)."""
    return dist.TCPStore(
        LOOPBACK, 0, world_size, is_master=True, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )  # fmt: skip


def connect_store(port: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    """A worker rank's client of rank 0's store."""
    return dist.TCPStore(
        LOOPBACK, port, world_size, is_master=False, timeout=datetime.timedelta(seconds=timeout_s)
    )


class TPComm:
    def __init__(
        self,
        rank: int,
        world_size: int,
        device: torch.device,
        store: dist.Store,
        timeout_s: float,
    ) -> None:
        """Join the group (blocks until every rank joined, at most `timeout_s`)."""
        if dist.is_initialized():
            raise TPError(
                "this process already runs a tensor-parallel engine (torch.distributed's "
                "default group is process-wide): close it first"
            )
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        self.diagnose: Callable[[BaseException], TPError] = _plain_error
        if self.backend == "gloo":
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # every rank is on this host
        dist.init_process_group(
            self.backend, store=store, rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device if device.type == "cuda" else None,
        )  # fmt: skip
        self._closed = False

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place; returns `x`."""
        try:
            dist.all_reduce(x)
        except RuntimeError as error:
            raise self.diagnose(error) from error
        return x

    def gather_to_first(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0: every rank's `x` concatenated along the last dim, in rank order; other
        ranks: their own `x` (they only send)."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.rank == 0 else None
        try:
            dist.gather(x, parts, dst=0)
        except RuntimeError as error:
            raise self.diagnose(error) from error
        return x if parts is None else torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` into every rank's `x` (same shape and dtype), in place."""
        try:
            dist.broadcast(x, src=0)
        except RuntimeError as error:
            raise self.diagnose(error) from error
        return x

    def min_int(self, value: int) -> int:
        """The smallest of every rank's `value`."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        try:
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
        except RuntimeError as error:
            raise self.diagnose(error) from error
        return int(t.item())

    def barrier(self) -> None:
        self.min_int(0)  # a collective on the group's device (NCCL's barrier guesses one)

    def set_timeout(self, timeout_s: float) -> None:
        """The timeout of every later collective on this rank."""
        c10d._set_pg_timeout(datetime.timedelta(seconds=timeout_s))

    def abort(self) -> None:
        """(another thread) Make a blocked NCCL collective fail now (a peer died). gloo needs
        none: a peer's closed socket fails it."""
        if self.backend == "nccl" and not self._closed:
            try:
                c10d._abort_process_group()
            except Exception:  # best effort: the group may be half torn down already
                logger.exception("aborting the NCCL process group failed")

    def destroy(self) -> None:
        if self._closed:
            return
        self._closed = True
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # an aborted or broken group: nothing left to release cleanly
                logger.warning("destroying the process group failed", exc_info=True)
