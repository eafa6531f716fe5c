"""`WorkerGroup`: rank 0's worker processes (ranks 1..N-1): started, watched, stopped.

```
start   one fresh interpreter per rank, `python -m engine.tp_worker FD PID` (nothing forked
        after torch's threads exist), started from one long-lived thread: PR_SET_PDEATHSIG
        fires when the *thread* that started a process ends, so that thread never does. Its
        socketpair end FD carries sys.path and the WorkerSpec, then the worker's reports
watch   a thread waits on every pipe: a report (an error at start) is kept; EOF means the
        worker is gone: `failure` names it (rank, pid, exit code or signal, its error), the
        other workers are killed and `on_failure` runs (abort: a blocked NCCL collective fails)
stop    (STOP went out through the step broadcast) wait `grace_s` for each exit, then
        SIGKILL; pipes closed (a worker also exits when its pipe closes); every process reaped
```
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any, cast

from engine.distributed.process_group import TPError

logger = logging.getLogger(__name__)

WORKER_MODULE = "engine.tp_worker"  # started by name: nothing here imports it


class _Spawner:
    """One daemon thread that starts every worker process (it lives as long as the process)."""

    def __init__(self) -> None:
        self._requests: queue.SimpleQueue[tuple[list[str], int, Future[subprocess.Popen[bytes]]]]
        self._requests = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def popen(self, argv: list[str], pass_fd: int) -> subprocess.Popen[bytes]:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tp-spawner", daemon=True)
                self._thread.start()
        future: Future[subprocess.Popen[bytes]] = Future()
        self._requests.put((argv, pass_fd, future))
        return future.result(timeout=60)

    def _run(self) -> None:
        while True:
            argv, pass_fd, future = self._requests.get()
            try:
                future.set_result(subprocess.Popen(argv, pass_fds=(pass_fd,)))
            except BaseException as error:
                future.set_exception(error)


_SPAWNER = _Spawner()


@dataclass
class _Worker:
    rank: int
    proc: subprocess.Popen[bytes]
    conn: Connection
    errors: list[str] = field(default_factory=list)


class WorkerGroup:
    def __init__(self, specs: Sequence[Any], on_failure: Callable[[], None] | None = None) -> None:
        """Start one worker per spec (each has `.rank`); `on_failure` runs once, on the
        watcher thread, when one dies unasked."""
        self.on_failure = on_failure
        self.failure: str | None = None
        self._failed = threading.Event()
        # kind -> rank -> what the worker reported: "joining" (it reached the group's init:
        # its pid), "ready" (its worker_init ran: what that returned)
        self._reports: dict[str, dict[int, Any]] = {"joining": {}, "ready": {}}
        self._reported = threading.Condition()
        self._stopping = False
        self._workers: list[_Worker] = []
        try:
            for spec in specs:
                self._workers.append(self._start(spec))
        except BaseException:
            self.stop(0.0)
            raise
        self._watcher = threading.Thread(target=self._watch, name="tp-watch", daemon=True)
        self._watcher.start()

    @property
    def pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers]

    def _start(self, spec: Any) -> _Worker:
        ours, theirs = socket.socketpair()
        conn = Connection(ours.detach())
        child_fd = theirs.detach()
        try:
            argv = [sys.executable, "-m", WORKER_MODULE, str(child_fd), str(os.getpid())]
            proc = _SPAWNER.popen(argv, child_fd)
        finally:
            os.close(child_fd)
        worker = _Worker(spec.rank, proc, conn)
        try:
            conn.send(list(sys.path))
            conn.send(spec)  # pickles worker_init: a module-level callable (or partial of one)
        except BaseException:
            proc.kill()
            proc.wait()
            conn.close()
            raise
        return worker

    def check(self) -> None:
        """Raise RuntimeError naming the worker that died, if one did."""
        if self.failure is not None:
            raise RuntimeError(self.failure)

    def wait_failure(self, timeout_s: float) -> str | None:
        """The failure, waiting up to `timeout_s` for the watcher to see one."""
        self._failed.wait(timeout_s)
        return self.failure

    def wait_reports(self, kind: str, timeout_s: float) -> dict[int, Any]:
        """Every worker's `kind` report ("joining": it imported, attached the broadcast and
        reached the store; "ready": its worker_init ran), by rank; TPError when one died or
        some did not report within `timeout_s` (they hang: they are killed)."""
        ranks = {w.rank for w in self._workers}
        reports = self._reports[kind]
        with self._reported:
            done = self._reported.wait_for(
                lambda: reports.keys() >= ranks or self.failure is not None, timeout_s
            )
        if self.failure is not None:
            raise TPError(self.failure)
        if not done:
            self.kill()
            missing = sorted(ranks - reports.keys())
            raise TPError(
                f"tensor-parallel ranks {missing} did not start within {timeout_s:g} s "
                "(tp_start_timeout_s): they hang"
            )
        return dict(reports)

    def _watch(self) -> None:
        by_conn = {w.conn: w for w in self._workers}
        while by_conn and not self._stopping:
            for conn in cast(list[Connection], wait(list(by_conn), timeout=0.5)):
                worker = by_conn[conn]
                try:
                    kind, value = conn.recv()
                except (EOFError, OSError):
                    del by_conn[conn]
                    self._gone(worker)
                    continue
                if kind == "error":
                    worker.errors.append(value)
                    logger.error("tensor-parallel rank %d failed:\n%s", worker.rank, value)
                elif kind in self._reports:
                    with self._reported:
                        self._reports[kind][worker.rank] = value
                        self._reported.notify_all()

    def _gone(self, worker: _Worker) -> None:
        """Its pipe closed: it died (or is dying: it is killed if it lingers)."""
        try:
            code: int | None = worker.proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:  # still tearing down (or stuck): it is gone for us
            code = None
        if self._stopping or self.failure is not None:
            worker.proc.kill()
            worker.proc.wait()
            return
        if code is None:
            how = "closed its pipe to rank 0"
        elif code < 0:
            how = f"was killed by {signal.Signals(-code).name}"
        else:
            how = f"exited ({code})"
        error = f": {worker.errors[-1].strip().splitlines()[-1]}" if worker.errors else ""
        self.failure = (
            f"tensor-parallel rank {worker.rank} (pid {worker.proc.pid}) {how}{error}; the "
            "engine stopped its other ranks and cannot continue"
        )
        logger.error("%s", self.failure)
        self.kill()
        self._failed.set()
        with self._reported:
            self._reported.notify_all()
        if self.on_failure is not None:
            self.on_failure()

    def kill(self) -> None:
        """SIGKILL every worker still running (a rank died or hung) and reap them."""
        for worker in self._workers:
            if worker.proc.poll() is None:
                worker.proc.kill()
        for worker in self._workers:
            worker.proc.wait()

    def stop(self, grace_s: float) -> None:
        """Wait up to `grace_s` for the workers to exit (after STOP), then kill the rest;
        close the pipes. Idempotent."""
        self._stopping = True
        for worker in self._workers:
            try:
                worker.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                logger.warning("tensor-parallel rank %d did not exit: killing it", worker.rank)
        self.kill()
        watcher = getattr(self, "_watcher", None)
        if watcher is not None and watcher is not threading.current_thread():
            watcher.join(timeout=5)  # it sees _stopping within one wait
        for worker in self._workers:
            worker.conn.close()
