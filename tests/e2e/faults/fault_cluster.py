"""`FaultCluster`: the real node processes the fault suite breaks (a RegistryCluster with small
KV pools and short timeouts), with what a fault needs: restart a node, freeze and thaw it,
its KV address, RSS and liveness, a router in registry mode or colocated (static, decode
nodes only), and `check()`: the invariants every fault asserts, written as a table row.

```python
with FaultCluster(tmp_path) as cluster:
    cluster.start_nodes(prefill=1, decode=2)
    async with cluster.router() as (router, client): ...
    cluster.kill("decode-1"); cluster.restart("decode-1")
    cluster.check("decode killed", outcomes, alive=["prefill-0", "decode-0"])
```
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import psutil

from pdserve.config import RouterConfig
from router.client import GenerationClient
from router.server import RouterServer
from tests.e2e.faults.fault_tools import CLEAR_CODES, Outcome, free_blocks_settled
from tests.e2e.faults.table import FaultRow, record
from tests.e2e.registry_cluster import (
    _LISTENING,
    LAUNCH_TIMEOUT_S,
    RegistryCluster,
    serving_router,
)

NUM_KV_BLOCKS = 96  # of 4 tokens: a few requests fill a pool (overload is cheap to reach)
TRANSFER_TIMEOUT_S = 3.0
QUEUE_TIMEOUT_S = 3.0
MAX_QUEUED = 8
NODE_FLAGS = dict(
    num_kv_blocks=NUM_KV_BLOCKS,
    transfer_timeout_s=TRANSFER_TIMEOUT_S,
    queue_timeout_s=QUEUE_TIMEOUT_S,
    max_queued_requests=MAX_QUEUED,
    bind_retry_s=10,
)
ROUTER_CONFIG = dict(transfer_timeout_s=TRANSFER_TIMEOUT_S, node_rpc_timeout_s=2.0)
MAX_RSS_GROWTH_MIB = 200.0  # per surviving node over one fault (allocator caches included)
SETTLE_S = 30.0  # how long pools may take to be whole again after the fault ends


class FaultCluster(RegistryCluster):
    def __init__(self, folder) -> None:
        super().__init__(folder)
        self._flags: dict[str, dict[str, Any]] = {}
        self.kv_addresses: dict[str, str] = {}
        self._rss_start: dict[str, float] = {}

    def start_nodes(self, prefill: int = 0, decode: int = 0, **flags: Any) -> list[str]:
        flags = {**NODE_FLAGS, **flags}
        names = super().start_nodes(prefill=prefill, decode=decode, **flags)
        for name in names:
            self._flags[name] = flags
        self._note_listening(names)
        return names

    def _listening_line(self, proc) -> str:  # type: ignore[override]
        """The node's listening line; other lines before it (UCX's own log, e.g. a bind it
        retries) are skipped, within LAUNCH_TIMEOUT_S (else the node is killed)."""
        deadline = time.monotonic() + LAUNCH_TIMEOUT_S
        skipped: list[str] = []
        pool = ThreadPoolExecutor(1)
        listening = None
        try:
            while listening is None:
                remaining = max(0.1, deadline - time.monotonic())
                line = pool.submit(proc.process.stdout.readline).result(timeout=remaining)
                if not line:
                    raise RuntimeError(f"{proc.name} exited ({proc.process.poll()}): {skipped}")
                listening = _LISTENING.match(line.rstrip("\n"))
                skipped = [*skipped[-20:], line]
        except TimeoutError:
            raise RuntimeError(f"{proc.name} did not start in time: {skipped}") from None
        finally:
            if listening is None:
                proc.process.kill()  # (its pipe closes: the reading thread ends)
            pool.shutdown(wait=False)
        self.kv_addresses[proc.name] = listening[2]
        return listening[0]

    def _note_listening(self, names: Sequence[str]) -> None:
        for name in names:
            self._rss_start.setdefault(name, self.rss_mib(name))

    def restart(self, name: str, same_ports: bool = False) -> None:
        """Start a killed node again under the same name, with the same flags: on new ports,
        or (`same_ports`) on the gRPC and KV ports it had bound."""
        role = name.split("-")[0]
        count = self._counts[role]
        self._counts[role] = int(name.split("-")[1])
        flags = self._flags[name]
        if same_ports:
            ports = (self.nodes[name].address, self.kv_addresses[name])
            port, kv_port = (int(address.rsplit(":", 1)[1]) for address in ports)
            flags = {**flags, "port": port, "kv_port": kv_port}
        try:
            proc = self._spawn(role, flags)
        finally:
            self._counts[role] = count
        line = self._listening_line(proc)
        proc.address = line.split()[3]
        self._rss_start[name] = self.rss_mib(name)

    def freeze(self, name: str) -> None:
        self.nodes[name].process.send_signal(signal.SIGSTOP)

    def thaw(self, name: str) -> None:
        self.nodes[name].process.send_signal(signal.SIGCONT)

    def alive(self, name: str) -> bool:
        return self.nodes[name].process.poll() is None

    def rss_mib(self, name: str) -> float:
        return psutil.Process(self.nodes[name].process.pid).memory_info().rss / 2**20

    @contextlib.asynccontextmanager
    async def router(self, **config: Any) -> AsyncIterator[tuple[RouterServer, GenerationClient]]:
        async with super().router(**{**ROUTER_CONFIG, **config}) as pair:
            yield pair

    @contextlib.asynccontextmanager
    async def colocated_router(
        self, decode: Sequence[str], **config: Any
    ) -> AsyncIterator[tuple[RouterServer, GenerationClient]]:
        """A router given only decode nodes (static addresses): every request prefills on D."""
        config = RouterConfig(
            port=0, http_port=0, grace_s=0.0, node_wait_s=10.0,
            decode_addrs=tuple(self.address(n) for n in decode),
            **{**ROUTER_CONFIG, **config},
        )  # fmt: skip
        async with serving_router(config) as pair:
            yield pair

    def check(
        self,
        fault: str,
        outcomes: Sequence[Outcome],
        alive: Sequence[str],
        deadline_s: float,
        allowed: frozenset = CLEAR_CODES,
        notes: str = "",
        min_completed: int = 1,
    ) -> FaultRow:
        """The invariants of every fault, recorded as a table row before they are asserted:
        the `alive` nodes did not crash, their pools are whole again, their RSS grew by less
        than MAX_RSS_GROWTH_MIB; every request got tokens or a status from `allowed` with a
        message, and none ran past `deadline_s` (its deadline) or hit DEADLINE_EXCEEDED."""
        crashed = [n for n in alive if not self.alive(n)]
        live = [n for n in alive if n not in crashed]
        settled = free_blocks_settled(self, live, SETTLE_S)
        leaked = sum(total - free for free, total in settled.values())
        rss_growth = {n: self.rss_mib(n) - self._rss_start[n] for n in live}
        completed = [o for o in outcomes if o.code is None]
        clear = [o for o in outcomes if o.code in allowed and o.details]
        hung = [
            o for o in outcomes
            if o.code == grpc.StatusCode.DEADLINE_EXCEEDED or o.elapsed_s > deadline_s
        ]  # fmt: skip
        unclear = [o for o in outcomes if o.code is not None and o not in clear and o not in hung]
        row = FaultRow(
            fault, len(outcomes), len(completed), len(clear), leaked, len(hung),
            notes + (f" crashed={crashed}" if crashed else ""),
        )  # fmt: skip
        record(row)
        assert not crashed, f"{fault}: nodes crashed: {crashed}"
        assert leaked == 0, f"{fault}: KV blocks not freed: {settled}"
        assert not hung, f"{fault}: past their deadline: {[(o.code, o.elapsed_s) for o in hung]}"
        assert not unclear, f"{fault}: unclear statuses: {[(o.code, o.details) for o in unclear]}"
        assert all(o.num_tokens > 0 and o.finish_reason for o in completed), fault
        assert len(completed) >= min_completed, f"{fault}: only {len(completed)} completed"
        grown = {n: g for n, g in rss_growth.items() if g > MAX_RSS_GROWTH_MIB}
        assert not grown, f"{fault}: RSS grew (MiB): {grown}"
        return row
