"""The processes of `pd-bench router`: instant nodes and a pd-router, each its own process.

```
Proc.start(argv, ready=regex)   subprocess (own session), stdout read on a thread; returns once
                                a line matches `ready` (its groups), or RuntimeError (the
                                process's last lines) after START_TIMEOUT_S
Proc.cpu_s()                    user + system CPU seconds so far (/proc/PID/stat)
Proc.stop()                     SIGTERM, then SIGKILL after STOP_GRACE_S; its output kept
InstantCluster                  fake decode (+ fake prefill) + pd-router on them
```
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque

START_TIMEOUT_S = 60.0
STOP_GRACE_S = 10.0
_TICKS_PER_S = os.sysconf("SC_CLK_TCK")
_ROUTER_READY = re.compile(r"pd-router listening on (\S+) \(http (\S+)\)")
_NODE_READY = re.compile(r"fake-node listening on (\S+)")


class Proc:
    def __init__(self, name: str, argv: list[str]) -> None:
        self.name = name
        self.argv = argv
        self.lines: deque[str] = deque(maxlen=2000)
        self._proc: subprocess.Popen[str] | None = None
        self._ready = threading.Event()
        self._pattern: re.Pattern[str] | None = None
        self.match: re.Match[str] | None = None

    @property
    def pid(self) -> int:
        assert self._proc is not None
        return self._proc.pid

    def start(self, ready: re.Pattern[str]) -> re.Match[str]:
        self._pattern = ready
        self._proc = subprocess.Popen(
            self.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True, bufsize=1,
        )  # fmt: skip
        threading.Thread(target=self._read, daemon=True, name=f"{self.name}-out").start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._ready.wait(0.1):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = "\n".join(list(self.lines)[-30:])
                raise RuntimeError(f"{self.name} did not start:\n{tail}")
        assert self.match is not None
        return self.match

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if not self._ready.is_set() and self._pattern is not None:
                match = self._pattern.search(line)
                if match:
                    self.match = match
                    self._ready.set()

    def cpu_s(self) -> float:
        """User + system CPU seconds of the process (its threads included)."""
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            return 0.0
        return (int(fields[11]) + int(fields[12])) / _TICKS_PER_S

    def stop(self) -> None:
        if self._proc is None or self._proc.poll() is not None:
            return
        self._proc.send_signal(signal.SIGTERM)
        try:
            self._proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait(STOP_GRACE_S)
        time.sleep(0.1)  # the reader thread takes the last lines


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class InstantCluster:
    """Instant nodes and one pd-router in front of them, each in its own process."""

    def __init__(
        self,
        disaggregated: bool,
        chunk_tokens: int,
        router_args: list[str],
        uvloop_nodes: bool,
        router_profile: str | None = None,
        router_cmd: list[str] | None = None,
    ) -> None:
        """`router_profile`: the router runs under cProfile, its stats written there at stop;
        `router_cmd`: the command that runs pd-router (default: this Python's router.cli)."""
        node = [sys.executable, "-m", "benchmarks.router.fake_nodes"]
        node += ["--chunk-tokens", str(chunk_tokens)] + (["--uvloop"] if uvloop_nodes else [])
        self.decode = Proc("fake decode", [*node, "--role", "decode"])
        self.prefill = Proc("fake prefill", [*node, "--role", "prefill"]) if disaggregated else None
        self.router_args = router_args
        self.router_profile = router_profile
        self.router_cmd = router_cmd or [sys.executable, "-m", "router.cli"]
        self.router: Proc | None = None
        self.decode_address = ""
        self.prefill_address: str | None = None
        self.address = ""
        self.url = ""

    def __enter__(self) -> InstantCluster:
        try:
            self.decode_address = self.decode.start(_NODE_READY).group(1)
            argv = list(self.router_cmd)
            if self.router_profile:
                argv = [
                    sys.executable,
                    "-m",
                    "benchmarks.router.profiled_router",
                    self.router_profile,
                ]
            argv += ["--decode", self.decode_address]
            if self.prefill is not None:
                self.prefill_address = self.prefill.start(_NODE_READY).group(1)
                argv += ["--prefill", self.prefill_address]
            argv += ["--port", "0", "--http-port", str(free_port()), *self.router_args]
            self.router = Proc("pd-router", argv)
            match = self.router.start(_ROUTER_READY)
            self.address, self.url = match.group(1), match.group(2)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        for proc in (self.router, self.prefill, self.decode):
            if proc is not None:
                proc.stop()

    def node_lines(self) -> list[str]:
        """The nodes' last output lines (their handler times come last)."""
        procs = [p for p in (self.prefill, self.decode) if p is not None]
        return [line for p in procs for line in p.lines]
