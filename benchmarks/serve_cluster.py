"""`BenchCluster`: a `pd-serve` cluster that `pd-bench serve` / `compare` start and stop.

```
ClusterSpec.parse("1P1D") / ("2P4D") / ("colocated:2")   -> prefill and decode node counts
start: pd-serve --prefill P --decode D --port 0 FLAGS  (own session; its log to a file)
       -> "pd-serve: router listening on ADDR" -> GetModelInfo answers -> ready (or timeout)
stop:  SIGTERM to pd-serve (it stops its nodes), SIGKILL to its session after a grace period
```
Torch-free: pd-serve's nodes load the model in their own processes.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from router.client import GenerationClient

_ROUTER_LINE = re.compile(r"pd-serve: router listening on (\S+)")
_SPEC = re.compile(r"^(\d+)P(\d+)D$", re.IGNORECASE)
_COLOCATED = re.compile(r"^colocated(?::(\d+))?$", re.IGNORECASE)
STOP_GRACE_S = 30.0


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


async def wait_ready(addr: str, timeout_s: float) -> None:
    """Until the router at `addr` answers GetModelInfo (it knows its nodes), or TimeoutError."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    async with GenerationClient(addr) as client:
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                await client.model_info(timeout_s=min(remaining, 5.0))
                return
            except grpc.aio.AioRpcError as error:
                last = f"{error.code().name}: {error.details()}"
            await asyncio.sleep(min(0.5, max(deadline - time.monotonic(), 0)))
    raise TimeoutError(f"router {addr} not ready after {timeout_s:g} s ({last})")


class BenchCluster:
    """One pd-serve process tree; `start()` returns the router's address."""

    def __init__(self, spec: ClusterSpec, serve_flags: list[str], log_path: Path,
                 timeout_s: float) -> None:  # fmt: skip
        self.spec = spec
        self.serve_flags = list(serve_flags)
        self.log_path = log_path
        self.timeout_s = timeout_s
        self.process: subprocess.Popen | None = None
        self.address: str | None = None
        self._found = threading.Event()

    def argv(self) -> list[str]:
        flags = self.serve_flags
        port = (
            [] if any(f == "--port" or f.startswith("--port=") for f in flags) else ["--port", "0"]
        )
        return [sys.executable, "-m", "pdserve.local_cluster", "--prefill", str(self.spec.num_prefill),
                "--decode", str(self.spec.num_decode), *port, *flags]  # fmt: skip

    def _watch(self, log) -> None:
        for line in self.process.stdout:
            log.write(line)
            log.flush()
            if self.address is None and (match := _ROUTER_LINE.search(line)):
                self.address = match.group(1)
                self._found.set()
        self._found.set()  # pd-serve exited

    def start(self) -> str:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("w", encoding="utf-8")
        self.process = subprocess.Popen(
            self.argv(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
        threading.Thread(target=self._watch, args=(log,), daemon=True).start()
        if not self._found.wait(self.timeout_s) or self.address is None:
            self.stop()
            raise RuntimeError(f"pd-serve ({self.spec.name}) did not start: {self._log_tail()}")
        try:
            asyncio.run(wait_ready(self.address, self.timeout_s))
        except TimeoutError as error:
            self.stop()
            raise RuntimeError(f"{error}; {self._log_tail()}") from None
        return self.address

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)  # the session this object started
            self.process.wait(10)

    def _log_tail(self, num_lines: int = 20) -> str:
        try:
            lines = self.log_path.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            lines = []
        tail = "\n".join(lines[-num_lines:])
        return f"last lines of {self.log_path}:\n{tail}"

    def __enter__(self) -> BenchCluster:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
