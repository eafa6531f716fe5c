"""Node processes of different tensor-parallel sizes on loopback (static addresses, no
registry), and in-process routers over any pair of them: prefill TP a -> decode TP b for the
hand-off between TP sizes, and a colocated TP 1 node as the reference.

```python
with TPNodes(transport="tcp") as nodes:
    nodes.start({"prefill-tp1": ("prefill", 1), "decode-tp2": ("decode", 2)})
    tokens = asyncio.run(nodes.generate(PROMPTS, prefill="prefill-tp1", decode="decode-tp2"))
    nodes.check_drained()      # every node: every block free, nothing pending on any rank
```

The tiny synthetic model (4 heads, 2 kv heads: TP 1 or 2; token-id prompts), block size 4,
a small step budget so long prompts prefill in chunks, one torch thread per process.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import psutil

from pdserve.config import RouterConfig
from pdserve.v1 import node_pb2, node_pb2_grpc
from router.client import GenerationClient
from tests.e2e.registry_cluster import _LISTENING, LAUNCH_TIMEOUT_S, serving_router

MODEL = "synthetic:tiny-llama"
RPC_TIMEOUT_S = 20.0
NODE_FLAGS = [
    "--model", MODEL, "--device", "cpu", "--dtype", "float32", "--block-size", "4",
    "--num-kv-blocks", "256", "--max-num-batched-tokens", "16", "--log-level", "warning",
    "--transfer-timeout-s", "20",
]  # fmt: skip


class TPNodes:
    def __init__(self, transport: str) -> None:
        self.transport = transport
        self.processes: dict[str, subprocess.Popen[str]] = {}
        self.addresses: dict[str, str] = {}

    def __enter__(self) -> TPNodes:
        return self

    def stop(self, timeout_s: float = 60.0) -> dict[str, int | None]:
        """SIGTERM every node; each one's exit code (None: still running after `timeout_s`)."""
        for process in self.processes.values():
            if process.poll() is None:
                process.terminate()
        codes: dict[str, int | None] = {}
        deadline = time.monotonic() + timeout_s
        for name, process in self.processes.items():
            try:
                codes[name] = process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                codes[name] = None
        return codes

    def __exit__(self, *exc_info: object) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.terminate()
        for process in self.processes.values():
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)

    def start(self, nodes: dict[str, tuple[str, int]]) -> None:
        """Start `name: (role, tp_size)` nodes together; return once each printed its line."""
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        for name, (role, tp) in nodes.items():
            argv = [sys.executable, "-m", f"{role}_node.cli", *NODE_FLAGS, "--port", "0",
                    "--kv-transport", self.transport, "--tensor-parallel-size", str(tp)]  # fmt: skip
            self.processes[name] = subprocess.Popen(
                argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env
            )
        with ThreadPoolExecutor(len(nodes)) as pool:
            lines = dict(zip(nodes, pool.map(self._listening_line, nodes)))
        for name, line in lines.items():
            self.addresses[name] = _LISTENING.match(line)[1]

    def _listening_line(self, name: str) -> str:
        process = self.processes[name]
        with ThreadPoolExecutor(1) as pool:
            line = pool.submit(process.stdout.readline).result(timeout=LAUNCH_TIMEOUT_S)
        if not _LISTENING.match(line.rstrip("\n")):
            process.kill()
            raise RuntimeError(f"{name} printed {line!r} (exit code {process.poll()})")
        return line.rstrip("\n")

    async def generate(
        self, prompts: list[list[int]], decode: str, prefill: str | None = None, **sampling: Any
    ) -> list[list[int]]:
        """Greedy tokens of each prompt through a router over `prefill` -> `decode` (no
        prefill node: `decode` prefills itself, colocated)."""
        config = RouterConfig(
            port=0, http_port=0, grace_s=0.0, node_wait_s=20.0,
            prefill_addrs=(self.addresses[prefill],) if prefill else (),
            decode_addrs=(self.addresses[decode],),
        )  # fmt: skip
        async with serving_router(config) as (_, client):
            return list(await asyncio.gather(*(_tokens(client, p, **sampling) for p in prompts)))

    def stats(self, name: str) -> node_pb2.NodeStats:
        with grpc.insecure_channel(self.addresses[name]) as channel:
            stub = node_pb2_grpc.NodeStub(channel)
            return stub.GetStats(node_pb2.GetStatsRequest(), timeout=RPC_TIMEOUT_S)

    def drained(self, timeout_s: float = 30.0) -> dict[str, node_pb2.NodeStats]:
        """Every node's stats once its pool is whole and no rank holds a hand-off (or the
        last ones seen after `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        while True:
            stats = {name: self.stats(name) for name in self.processes}
            if all(_drained(s) for s in stats.values()) or time.monotonic() > deadline:
                return stats
            time.sleep(0.1)

    def ranks(self, name: str) -> list[psutil.Process]:
        """The node's processes: rank 0, then its other ranks."""
        rank0 = psutil.Process(self.processes[name].pid)
        return [rank0, *rank0.children(recursive=True)]


def _drained(stats: node_pb2.NodeStats) -> bool:
    return stats.num_free_kv_blocks == stats.num_kv_blocks and stats.num_pending_transfers == 0


async def _tokens(client: GenerationClient, prompt: list[int], **sampling: Any) -> list[int]:
    params = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True, **sampling}
    result = await client.generate_all(prompt_token_ids=prompt, timeout_s=RPC_TIMEOUT_S, **params)
    return list(result.token_ids)
