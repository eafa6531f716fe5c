"""`ServeCluster` (for `pd-bench ttft`): a `pd-serve` subprocess for benchmarks, with the router's and every node's
gRPC address parsed from its output, node stats over gRPC, and a clean stop (SIGINT, as
Ctrl-C)."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
from collections import deque

import grpc

from pdserve.v1 import node_pb2, node_pb2_grpc

_ROUTER = re.compile(r"pd-serve: router listening on (\S+)")
_NODE = re.compile(r"\[(prefill|decode)-(\d+)\] pd-\w+ listening on (\S+)")


class ServeCluster:
    def __init__(self, argv: list[str], start_timeout_s: float = 900.0) -> None:
        """`argv`: pd-serve flags (the router listens on a free port)."""
        self.argv = argv
        self.start_timeout_s = start_timeout_s
        self.router: str | None = None
        self.nodes: dict[str, str] = {}  # "prefill-0" -> host:port
        self.log: deque[str] = deque(maxlen=200)
        self._ready = threading.Event()
        self._process: subprocess.Popen | None = None

    def __enter__(self) -> ServeCluster:
        cmd = [sys.executable, "-u", "-m", "pdserve.local_cluster", "--port", "0", *self.argv]
        self._process = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        threading.Thread(target=self._read, daemon=True).start()
        if not self._ready.wait(self.start_timeout_s) or self.router is None:
            self.stop()
            raise RuntimeError("pd-serve did not start:\n" + "".join(list(self.log)[-40:]))
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _read(self) -> None:
        assert self._process is not None and self._process.stdout is not None
        for line in self._process.stdout:
            self.log.append(line)
            if match := _NODE.search(line):
                self.nodes[f"{match.group(1)}-{match.group(2)}"] = match.group(3)
            if match := _ROUTER.search(line):
                self.router = match.group(1)
                self._ready.set()
        self._ready.set()

    def node_stats(self, name: str, timeout_s: float = 10.0) -> node_pb2.NodeStats:
        with grpc.insecure_channel(self.nodes[name]) as channel:
            stub = node_pb2_grpc.NodeStub(channel)
            return stub.GetStats(node_pb2.GetStatsRequest(), timeout=timeout_s)

    def stop(self, timeout_s: float = 60.0) -> None:
        process = self._process
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
