"""A throwaway redis-server for registry tests: a free loopback port, a temporary folder, no
persistence (`--save "" --appendonly no`); `kill` (SIGKILL) and `start` again on the same port
play a Redis crash and restart. Every wait is bounded.

Needs `redis-server` on PATH (Redis 6+; `apt-get install redis-server`; `make test` installs it).
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from tests.ports import free_port

START_TIMEOUT_S = 10.0
PORT_ATTEMPTS = 5  # a free port picked here may be taken before redis binds it (parallel tests)


class PortTakenError(RuntimeError):
    pass


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
        self._port_chosen_here = port is None  # and never bound yet: another may be picked
        self.process: subprocess.Popen | None = None
        self.args = args
        self.client_kwargs = client_kwargs or {}

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        """Starts it and waits until it answers (it, not another server on its port). A port
        picked here that another process took meanwhile is replaced by another free one (before
        the first start only: a restart keeps its port)."""
        for _ in range(PORT_ATTEMPTS - 1):
            try:
                return self._start_once()
            except PortTakenError:
                self.port = free_port()
        return self._start_once()

    def _start_once(self) -> RedisServer:
        self.folder.mkdir(parents=True, exist_ok=True)
        argv = [self.executable, "--port", str(self.port), "--bind", "127.0.0.1"]
        argv += ["--save", "", "--appendonly", "no", "--dir", str(self.folder), *self.args]
        log_path = self.folder / "redis.log"
        log_start = log_path.stat().st_size if log_path.exists() else 0  # this start's lines
        log = log_path.open("ab")
        self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.process.poll() is None and self._answers():
                self._port_chosen_here = False
                return self
            if self.process.poll() is not None or time.monotonic() > deadline:
                log_text = log_path.read_bytes()[log_start:].decode(errors="replace")
                self.kill()
                if self._port_chosen_here and "Address already in use" in log_text:
                    raise PortTakenError(self.port)
                raise RuntimeError(f"redis-server did not start:\n{log_text}")
            time.sleep(0.02)

    def _answers(self) -> bool:
        """Whether this process (not another server that has the port) answers on the port."""
        try:
            with self.client(retry=Retry(NoBackoff(), 0)) as client:  # one try: polled anyway
                return client.info("server")["process_id"] == self.process.pid
        except redis.RedisError:
            return False

    def client(self, **kwargs: Any) -> redis.Redis:
        return redis.Redis(
            port=self.port,
            socket_timeout=2.0,
            socket_connect_timeout=2.0,
            **self.client_kwargs,
            **kwargs,
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
