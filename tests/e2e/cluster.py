"""A real local cluster for end-to-end tests: `pd-serve` as a subprocess on loopback.

Parses the router address and every node's gRPC address from pd-serve's output, gives gRPC
helpers for node stats, and on stop checks that every process pd-serve started is gone.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import grpc

from pdserve.v1 import node_pb2, node_pb2_grpc

START_TIMEOUT_S = 300.0
_ROUTER = re.compile(r"pd-serve: router listening on (\S+)")
_NODE = re.compile(r"\[(prefill|decode)-(\d+)\] pd-\w+ listening on (\S+)")


def _children_of(pid: int) -> list[int]:
    children = []
    for entry in os.listdir("/proc"):
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


@dataclass
class Cluster:
    args: list[str]
    process: subprocess.Popen | None = None
    router: str | None = None
    nodes: dict[str, str] = field(default_factory=dict)  # "decode-0" -> host:port
    log: list[str] = field(default_factory=list)
    _ready: threading.Event = field(default_factory=threading.Event)

    def start(self) -> Cluster:
        http = [] if "--http-port" in self.args else ["--http-port", "0"]  # not 8000: tests overlap
        self.process = subprocess.Popen(
            [sys.executable, "-u", "-m", "pdserve.local_cluster", "--port", "0", *http, *self.args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        threading.Thread(target=self._read, daemon=True).start()
        if not self._ready.wait(START_TIMEOUT_S) or self.router is None:
            self.stop()
            raise RuntimeError("pd-serve did not start:\n" + "".join(self.log[-40:]))
        return self

    def _read(self) -> None:
        for line in self.process.stdout:
            self.log.append(line)
            if match := _NODE.search(line):
                self.nodes[f"{match.group(1)}-{match.group(2)}"] = match.group(3)
            if match := _ROUTER.search(line):
                self.router = match.group(1)
                self._ready.set()
        self._ready.set()

    def node_stats(self, name: str) -> node_pb2.NodeStats:
        with grpc.insecure_channel(self.nodes[name]) as channel:
            stub = node_pb2_grpc.NodeStub(channel)
            return stub.GetStats(node_pb2.GetStatsRequest(), timeout=10)

    def wait_all_blocks_free(self, timeout_s: float) -> dict[str, node_pb2.NodeStats]:
        """Poll every node until its KV pool is entirely free; return the last stats."""
        deadline = time.monotonic() + timeout_s
        while True:
            stats = {name: self.node_stats(name) for name in self.nodes}
            if all(s.num_free_kv_blocks == s.num_kv_blocks for s in stats.values()):
                return stats
            if time.monotonic() > deadline:
                return stats
            time.sleep(0.05)

    def stop(self, sig: int = signal.SIGINT, timeout_s: float = 30.0) -> list[int]:
        """Stop pd-serve as Ctrl-C would; return the pids it had started that are still alive."""
        if self.process is None or self.process.poll() is not None:
            return []
        children = _children_of(self.process.pid)
        self.process.send_signal(sig)
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(5)
        return [pid for pid in children if _alive(pid)]
