"""A throwaway redis-server for registry tests: a free loopback port, a temporary folder, no
persistence (`--save "" --appendonly no`); `kill` (SIGKILL) and `start` again on the same port
play a Redis crash and restart. Every wait is bounded.

Needs `redis-server` on PATH (Redis 6+; `apt-get install redis-server`; `make test` installs it).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis

START_TIMEOUT_S = 10.0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class RedisServer:
    """One redis-server process (restartable on the same port)."""

    def __init__(
        self,
        folder: Path,
        port: int | None = None,
        args: tuple[str, ...] = (),
        client_kwargs: dict | None = None,
    ) -> None:
        """`args`: more redis-server flags (ACL users, TLS); `client_kwargs`: what the
        readiness probe's client needs to get in (credentials, TLS files)."""
        executable = shutil.which("redis-server")
        if executable is None:
            raise RuntimeError(
                "redis-server not found: install Redis 6+ (apt-get install redis-server); "
                "`make test` does it"
            )
        self.executable = executable
        self.folder = folder
        self.port = port or free_port()
        self.process: subprocess.Popen | None = None
        self.args = args
        self.client_kwargs = client_kwargs or {}

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        """Starts it and waits until it answers PING."""
        self.folder.mkdir(parents=True, exist_ok=True)
        argv = [self.executable, "--port", str(self.port), "--bind", "127.0.0.1"]
        argv += ["--save", "", "--appendonly", "no", "--dir", str(self.folder), *self.args]
        log = (self.folder / "redis.log").open("ab")
        self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                with self.client() as client:
                    client.ping()
                return self
            except redis.RedisError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    log_text = (self.folder / "redis.log").read_text(errors="replace")
                    self.kill()
                    raise RuntimeError(f"redis-server did not start:\n{log_text}") from None
                time.sleep(0.02)

    def client(self) -> redis.Redis:
        return redis.Redis(
            port=self.port, socket_timeout=2.0, socket_connect_timeout=2.0, **self.client_kwargs
        )

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)
        self.process = None

    def restart(self) -> None:
        self.kill()
        self.start()
