"""`BenchCluster`: the one launcher of a local `pd-serve` cluster, for `pd-bench serve` /
`compare` / `ttft` and the end-to-end tests (`tests/e2e/cluster.py`).

```
ClusterSpec.parse("1P1D") / ("2P4D") / ("colocated:2")   -> prefill and decode node counts
start: pd-serve [--prefill P --decode D] --port 0 --http-port 0 FLAGS  (own session)
       -> "[decode-0] pd-decode listening on ADDR" ...  -> `nodes`
       -> "pd-serve: router listening on ADDR"          -> `address`
       -> GetModelInfo answers -> ready (or RuntimeError with the log's last lines)
node_stats("prefill-0"): a node's NodeStats over gRPC
kv_counters(decode_addresses(), security()): the hand-offs' KV bytes moved and skipped
stop:  SIGINT to pd-serve, as Ctrl-C (it stops its nodes), SIGKILL to its session after a grace period;
       returns the pids pd-serve had started that outlived it
```
pd-serve's output goes to `log` (its last lines) and, when given, to a log file; with
`progress`, its own lines ("pd-serve: ...": what it waits for, where it listens) also to
stderr while it starts. Torch-free: pd-serve's nodes load the model in their own processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import grpc

from pdserve import envs
from pdserve.config import SecurityConfig
from pdserve.grpc_security import open_channel
from pdserve.security import AUTH_METADATA_KEY, ClusterAuth, load_cluster_auth, read_secret
from pdserve.v1 import node_pb2, node_pb2_grpc
from router.client import GenerationClient

_ROUTER_LINE = re.compile(r"pd-serve: router listening on (\S+)")
_NODE_LINE = re.compile(r"\[(prefill|decode)-(\d+)\] pd-\w+ listening on (\S+)")
_SPEC = re.compile(r"^(\d+)P(\d+)D$", re.IGNORECASE)
_COLOCATED = re.compile(r"^colocated(?::(\d+))?$", re.IGNORECASE)
START_TIMEOUT_S = 900.0  # a first start may convert the model; a large one loads for minutes
STOP_GRACE_S = 30.0
RPC_TIMEOUT_S = 10.0
LOG_LINES_KEPT = 400  # `BenchCluster.log`: the last lines of pd-serve's output
LOG_LINES_SHOWN = 40  # in the error when it does not start


@dataclass(frozen=True)
class ClusterSpec:
    """How many prefill and decode nodes; `name` as the user wrote it."""

    name: str
    num_prefill: int
    num_decode: int

    @classmethod
    def parse(cls, text: str) -> ClusterSpec:
        text = text.strip()
        if match := _SPEC.match(text):
            spec = cls(text, int(match.group(1)), int(match.group(2)))
        elif match := _COLOCATED.match(text):
            spec = cls(text, 0, int(match.group(1) or 1))
        else:
            raise ValueError(
                f"cluster {text!r}: write NPMD (e.g. 1P1D: 1 prefill + 1 decode node) or "
                "colocated[:N] (N decode nodes that prefill locally)"
            )
        if spec.num_decode < 1:
            raise ValueError(f"cluster {text!r} needs at least one decode node")
        return spec

    def flags(self) -> list[str]:
        return ["--prefill", str(self.num_prefill), "--decode", str(self.num_decode)]


async def wait_ready(addr: str, timeout_s: float) -> None:
    """Until the router at `addr` answers GetModelInfo (it knows its nodes), or TimeoutError.
    A router with --api-key-file gets the key PDSERVE_API_KEY names."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    async with GenerationClient(addr, envs.api_key()) as client:
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                await client.model_info(timeout_s=min(remaining, 5.0))
                return
            except grpc.aio.AioRpcError as error:
                last = f"{error.code().name}: {error.details()}"
            await asyncio.sleep(min(0.5, max(deadline - time.monotonic(), 0)))
    raise TimeoutError(f"router {addr} not ready after {timeout_s:g} s ({last})")


def _children_of(pid: int) -> list[int]:
    """The pids whose parent is `pid` (from /proc; empty where there is none)."""
    children = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            children.append(int(entry))
    return children


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


_GET_STATS = "/pdserve.v1.Node/GetStats"


def _given(flags: list[str], name: str) -> bool:
    return any(f == name or f.startswith(name + "=") for f in flags)


class BenchCluster:
    """One pd-serve process tree; `start()` returns the router's address.

    `spec`: the node counts (None: `serve_flags` say them, or pd-serve's default 1P1D).
    `--port 0` and `--http-port 0` (a free gRPC port, no HTTP API) unless `serve_flags` set them.
    """

    def __init__(self, spec: ClusterSpec | None, serve_flags: list[str],
                 log_path: Path | None = None, timeout_s: float = START_TIMEOUT_S,
                 progress: bool = False) -> None:  # fmt: skip
        self.spec = spec
        self.progress = progress  # echo pd-serve's own lines to stderr until it is ready
        self.num_log_lines = 0  # lines pd-serve wrote so far (log_since counts from one)
        self.serve_flags = list(serve_flags)
        self.log_path = log_path
        self.timeout_s = timeout_s
        self.process: subprocess.Popen[str] | None = None
        self._address: str | None = None  # the router's host:port, once it said it
        self.nodes: dict[str, str] = {}  # "prefill-0" -> host:port
        self.log: deque[str] = deque(maxlen=LOG_LINES_KEPT)
        self._found = threading.Event()

    @property
    def address(self) -> str:
        """The router's host:port (RuntimeError before `start` found it)."""
        if self._address is None:
            raise RuntimeError(f"pd-serve ({self.name}) has not started")
        return self._address

    @property
    def name(self) -> str:
        return self.spec.name if self.spec is not None else "pd-serve"

    def argv(self) -> list[str]:
        flags = self.serve_flags
        counts = self.spec.flags() if self.spec is not None else []
        ports = [] if _given(flags, "--port") else ["--port", "0"]
        ports += [] if _given(flags, "--http-port") else ["--http-port", "0"]
        return [sys.executable, "-m", "pdserve.local_cluster", *counts, *ports, *flags]

    def _watch(self, stdout: IO[str], log_file: IO[str] | None) -> None:
        for line in stdout:
            self.log.append(line)
            self.num_log_lines += 1
            if self.progress and not self._found.is_set() and line.startswith("pd-serve:"):
                sys.stderr.write(line)
            if log_file is not None:
                log_file.write(line)
                log_file.flush()
            if match := _NODE_LINE.search(line):
                self.nodes[f"{match.group(1)}-{match.group(2)}"] = match.group(3)
            if self._address is None and (match := _ROUTER_LINE.search(line)):
                self._address = match.group(1)
                self._found.set()
        self._found.set()  # pd-serve exited
        if log_file is not None:
            log_file.close()

    def start(self) -> str:
        if self.progress:
            where = f"; its log: {self.log_path}" if self.log_path is not None else ""
            print(f"pd-bench: starting pd-serve ({self.name}){where}", file=sys.stderr)
        log_file = None
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            log_file = self.log_path.open("w", encoding="utf-8")
        self.process = subprocess.Popen(
            self.argv(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
        assert self.process.stdout is not None  # stdout=PIPE
        watch_args = (self.process.stdout, log_file)
        threading.Thread(target=self._watch, args=watch_args, daemon=True).start()
        address = self._address if self._found.wait(self.timeout_s) else None
        if address is None:
            self.stop()
            raise RuntimeError(f"pd-serve ({self.name}) did not start: {self._log_tail()}")
        try:
            asyncio.run(wait_ready(address, self.timeout_s))
        except TimeoutError as error:
            self.stop()
            raise RuntimeError(f"{error}; {self._log_tail()}") from None
        return address

    def log_since(self, num_lines: int) -> list[str]:
        """The lines pd-serve wrote after its first `num_lines` (those still kept in `log`)."""
        kept = list(self.log)
        return kept[max(0, len(kept) - (self.num_log_lines - num_lines)) :]

    def node_stats(self, name: str, timeout_s: float = RPC_TIMEOUT_S) -> node_pb2.NodeStats:
        """Node `name` ("decode-0")'s stats over gRPC (proving the cluster secret pd-serve was
        given, if any: `--cluster-secret-file` or PDSERVE_CLUSTER_SECRET_FILE)."""
        address = self.nodes[name]
        metadata = None
        if (secret := self._secret_file()) is not None:
            proof = ClusterAuth(read_secret(secret)).call_token(_GET_STATS, address)
            metadata = ((AUTH_METADATA_KEY, proof),)
        with grpc.insecure_channel(address) as channel:
            stub = node_pb2_grpc.NodeStub(channel)
            return stub.GetStats(node_pb2.GetStatsRequest(), timeout=timeout_s, metadata=metadata)

    def _secret_file(self) -> str | None:
        for i, flag in enumerate(self.serve_flags):
            if flag.startswith("--cluster-secret-file="):
                return flag.split("=", 1)[1]
            if flag == "--cluster-secret-file" and i + 1 < len(self.serve_flags):
                return self.serve_flags[i + 1]
        return envs.cluster_secret_file()

    def decode_addresses(self) -> list[str]:
        return [address for name, address in self.nodes.items() if name.startswith("decode")]

    def security(self) -> SecurityConfig:
        """The cluster secret pd-serve was given (--cluster-secret-file), to call its nodes."""
        return SecurityConfig(cluster_secret_file=self._secret_file())

    def stop(self, sig: int = signal.SIGINT, timeout_s: float = STOP_GRACE_S) -> list[int]:
        """Stop pd-serve with `sig` (it stops its nodes); return the pids it had started that
        outlived it (then killed with the rest of its session)."""
        if self.process is None or self.process.poll() is not None:
            return []
        children = _children_of(self.process.pid)
        self.process.send_signal(sig)
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._kill_session()
            self.process.wait(10)
        leftover = [pid for pid in children if _alive(pid)]
        if leftover:
            self._kill_session()
        return leftover

    def _kill_session(self) -> None:
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError):  # the session this object started
            os.killpg(self.process.pid, signal.SIGKILL)

    def _log_tail(self) -> str:
        tail = "".join(list(self.log)[-LOG_LINES_SHOWN:])
        where = f" (all of it in {self.log_path})" if self.log_path is not None else ""
        return f"last lines of its output{where}:\n{tail}"

    def __enter__(self) -> BenchCluster:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


async def kv_counters(addresses: list[str], security: SecurityConfig) -> tuple[int, int]:
    """(KV bytes moved, KV bytes skipped) by the successful hand-offs of the nodes at
    `addresses` (NodeStats; with the cluster secret when there is one)."""
    auth = load_cluster_auth(security)
    moved = skipped = 0
    for address in addresses:
        channel = open_channel(address, security, auth)
        try:
            stats = await node_pb2_grpc.NodeStub(channel).GetStats(
                node_pb2.GetStatsRequest(), timeout=RPC_TIMEOUT_S
            )
        finally:
            await channel.close()
        moved += stats.num_kv_transfer_bytes
        skipped += stats.num_kv_skipped_bytes
    return moved, skipped
