"""Real pd-prefill / pd-decode processes that register in a real Redis, for registry and
routing tests; the router runs in the test's event loop (its counters are then readable).

```python
with RegistryCluster(tmp_path) as cluster:          # redis-server on a free port
    cluster.start_nodes(prefill=1, decode=2)        # launched together; each prints its line
    async with cluster.router(policy="least_loaded") as router: ...
    cluster.kill("decode-1")                        # SIGKILL
    cluster.stats("decode-0").num_finished_requests
```

The tiny synthetic model (no tokenizer: token-id prompts), one torch thread per node, a short
heartbeat. Every wait is bounded; every process is killed at exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from pdserve.config import RegistryConfig, RouterConfig
from pdserve.registry import NODE_KEY_PATTERN, NodeRecord
from pdserve.v1 import node_pb2, node_pb2_grpc
from router.client import GenerationClient
from router.server import RouterServer
from tests.redis_server import RedisServer

MODEL = "synthetic:tiny-llama"  # vocab 512, 1024 positions
BLOCK_SIZE = 4
HEARTBEAT_S = 0.3
TTL_S = 1.0
LAUNCH_TIMEOUT_S = (
    180.0  # a bound, not an expectation: node starts take seconds, more on a loaded box
)
RPC_TIMEOUT_S = 10.0
_LISTENING = re.compile(r"^pd-\w+ listening on (\S+) \(kv (\S+)\)$")


@dataclass
class NodeProc:
    name: str  # "decode-0"
    process: subprocess.Popen
    address: str = ""


class RegistryCluster:
    """A Redis server and the node processes registered in it."""

    def __init__(self, folder: Path) -> None:
        self.redis = RedisServer(folder / "redis")
        self.nodes: dict[str, NodeProc] = {}
        self._counts = {"prefill": 0, "decode": 0}

    @property
    def registry(self) -> RegistryConfig:
        return RegistryConfig(self.redis.url, heartbeat_s=HEARTBEAT_S, ttl_s=TTL_S)

    def __enter__(self) -> RegistryCluster:
        self.redis.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        for node in self.nodes.values():
            if node.process.poll() is None:
                node.process.kill()
            node.process.wait(10)
        self.redis.kill()

    def start_nodes(self, prefill: int = 0, decode: int = 0, **flags: Any) -> list[str]:
        """Launches the nodes together; returns their names once each printed its line."""
        procs = [self._spawn("decode", flags) for _ in range(decode)]
        procs += [self._spawn("prefill", flags) for _ in range(prefill)]
        with ThreadPoolExecutor(len(procs)) as pool:
            lines = list(pool.map(lambda p: self._listening_line(p), procs))
        for proc, line in zip(procs, lines):
            proc.address = _LISTENING.match(line)[1]
        return [proc.name for proc in procs]

    def kill(self, name: str) -> None:
        """SIGKILL: no deregistration, its record expires."""
        self.nodes[name].process.send_signal(signal.SIGKILL)
        self.nodes[name].process.wait(10)

    def address(self, name: str) -> str:
        return self.nodes[name].address

    def stats(self, name: str) -> node_pb2.NodeStats:
        with grpc.insecure_channel(self.address(name)) as channel:
            stub = node_pb2_grpc.NodeStub(channel)
            return stub.GetStats(node_pb2.GetStatsRequest(), timeout=RPC_TIMEOUT_S)

    def counters(self, field: str) -> dict[str, int]:
        """`field` of every live node's NodeStats, by name."""
        live = [n for n, proc in self.nodes.items() if proc.process.poll() is None]
        return {name: getattr(self.stats(name), field) for name in live}

    def registered_roles(self) -> list[str]:
        """The roles of the records in Redis now, sorted."""
        with self.redis.client() as client:
            values = [client.get(key) for key in client.scan_iter(NODE_KEY_PATTERN)]
        return sorted(NodeRecord.from_json(v).role for v in values if v is not None)

    @contextlib.asynccontextmanager
    async def router(self, **config: Any) -> AsyncIterator[tuple[RouterServer, GenerationClient]]:
        """An in-process router following the registry, and a client of it."""
        config = RouterConfig(
            port=0, http_port=0, registry=self.registry, node_wait_s=10.0, grace_s=0.0, **config
        )
        async with serving_router(config) as pair:
            yield pair

    def _spawn(self, role: str, flags: dict[str, Any]) -> NodeProc:
        name = f"{role}-{self._counts[role]}"
        self._counts[role] += 1
        argv = [sys.executable, "-m", f"{role}_node.cli", "--model", MODEL, "--device", "cpu"]
        argv += ["--dtype", "float32", "--block-size", str(BLOCK_SIZE), "--num-kv-blocks", "1024"]
        argv += ["--kv-transport", "tcp", "--log-level", "warning", "--registry", self.redis.url]
        argv += ["--registry-heartbeat-s", str(HEARTBEAT_S), "--registry-ttl-s", str(TTL_S)]
        for flag, value in flags.items():
            argv += [f"--{flag.replace('_', '-')}", str(value)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}  # 2 cores shared by every process
        process = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env
        )
        self.nodes[name] = NodeProc(name, process)
        return self.nodes[name]

    @staticmethod
    def _listening_line(proc: NodeProc) -> str:
        with ThreadPoolExecutor(1) as pool:
            line = pool.submit(proc.process.stdout.readline).result(timeout=LAUNCH_TIMEOUT_S)
        if not _LISTENING.match(line.rstrip("\n")):
            proc.process.kill()
            raise RuntimeError(f"{proc.name} printed {line!r} (exit code {proc.process.poll()})")
        return line.rstrip("\n")


class LoadLoop:
    """Sends token-id requests back to back from `num_workers` tasks, recording every outcome;
    `errors` holds (when the request started, monotonic; what failed)."""

    def __init__(self, client: GenerationClient, num_workers: int = 2, max_tokens: int = 8):
        self._client = client
        self._num_workers = num_workers
        self._max_tokens = max_tokens
        self.num_ok = 0
        self.errors: list[tuple[float, str]] = []
        self._tasks: list[asyncio.Task] = []

    def start(self) -> LoadLoop:
        self._tasks = [asyncio.create_task(self._work(i)) for i in range(self._num_workers)]
        return self

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def until(self, num_ok: int, timeout_s: float = 20.0) -> None:
        """Waits until `num_ok` more requests succeeded."""
        target = self.num_ok + num_ok
        async with asyncio.timeout(timeout_s):
            while self.num_ok < target:
                await asyncio.sleep(0.02)

    async def _work(self, worker: int) -> None:
        prompt = [3 + worker, 10, 11, 12, 13]
        while True:
            started_s = time.monotonic()
            try:
                result = await self._client.generate_all(
                    prompt_token_ids=prompt, max_tokens=self._max_tokens, temperature=0.0,
                    ignore_eos=True, timeout_s=RPC_TIMEOUT_S,
                )  # fmt: skip
            except grpc.aio.AioRpcError as error:
                self.errors.append((started_s, f"{error.code().name}: {error.details()}"))
                continue
            if len(result.token_ids) != self._max_tokens:
                self.errors.append((started_s, f"{len(result.token_ids)} tokens: {result}"))
            self.num_ok += 1


@contextlib.asynccontextmanager
async def serving_router(
    config: RouterConfig,
) -> AsyncIterator[tuple[RouterServer, GenerationClient]]:
    """An in-process router started with `config`, and a client of it; both closed at exit."""
    router = RouterServer(config)
    await router.start()
    client = GenerationClient(router.address)
    try:
        yield router, client
    finally:
        await client.close()
        await router.stop()


async def eventually(predicate, timeout_s: float = 10.0, interval_s: float = 0.05) -> None:
    """Polls `predicate` (blocking calls run in a thread) until true; AssertionError after
    `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not await asyncio.to_thread(predicate):
        if time.monotonic() > deadline:
            raise AssertionError(f"not true within {timeout_s} s")
        await asyncio.sleep(interval_s)
