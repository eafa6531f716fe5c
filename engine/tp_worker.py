"""A tensor-parallel worker rank (ranks 1..N-1): `python -m engine.tp_worker FD PARENT_PID`,
started by rank 0's EngineCore (engine/distributed/worker_group.py); never by hand.

```
prctl(PR_SET_PDEATHSIG, SIGKILL); exit if rank 0 is already gone
pipe FD: rank 0's sys.path, then the WorkerSpec; a thread reads the pipe from then on:
         EOF (rank 0 gone, or it closed the pipe) -> exit at once, whatever the rank was doing
TensorParallel.join: the step broadcast, report "joining", the process group
EngineCore(config, tp=...): the same engine as rank 0's around this rank's shard (its weights,
         a KV pool of the agreed size, CUDA graphs), then worker_init(core) if given: what it
         returns goes to rank 0 over the pipe
ready: the start barrier, then the step timeout
loop:    receive a step -> ModelRunner.follow (rank 0's inputs, the same forward, the layer hook
         with rank 0's prefill chunks, this rank's logits slice to rank 0) ... until STOP
```

Any error is reported to rank 0 over the pipe (its watcher logs it and names it when the rank's
death fails the engine) and the process exits non-zero. This module lives in engine/, not
engine/distributed/, because it builds an EngineCore (which imports engine/distributed).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import traceback
from multiprocessing.connection import Connection

_PR_SET_PDEATHSIG = 1
logger = logging.getLogger(__name__)


def _die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when the thread that started it ends (rank 0's spawner thread
    lives as long as rank 0); exit now if rank 0 is already gone."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(1)


def _watch_pipe(conn: Connection) -> None:
    """Exit at once when the pipe to rank 0 closes (the rank may be blocked anywhere)."""
    try:
        while True:
            conn.recv()
    except (EOFError, OSError):
        os._exit(1)


def _serve(conn: Connection) -> None:
    from engine.distributed import TensorParallel, WorkerSpec
    from engine.engine_core import EngineCore
    from pdserve.logs import configure_logging

    spec: WorkerSpec = conn.recv()
    threading.Thread(target=_watch_pipe, args=(conn,), name="tp-pipe", daemon=True).start()
    configure_logging(logging.getLevelName(spec.log_level).lower(), f"tp-rank{spec.rank}")
    tp = TensorParallel.join(spec, lambda: conn.send(("joining", os.getpid())))
    core = EngineCore(spec.config, tp=tp)
    result = spec.worker_init(core) if spec.worker_init is not None else None
    conn.send(("ready", result))  # rank 0: TensorParallel.worker_results[rank]
    tp.ready()
    logger.info("tensor-parallel rank %d of %d ready on %s", tp.rank, tp.world_size, tp.device)
    while (message := tp.receive_step()) is not None:
        core.runner.follow(message, tp, core.on_layer_done)
    tp.close()


def main(argv: list[str]) -> int:
    fd, parent_pid = int(argv[0]), int(argv[1])
    _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches rank 0, which stops us
    conn = Connection(fd)
    sys.path[:0] = [p for p in conn.recv() if p not in sys.path]  # rank 0's (worker_init's module)
    try:
        _serve(conn)
    except BaseException:
        text = traceback.format_exc()
        try:
            conn.send(("error", text))  # rank 0's watcher logs it
        except OSError:
            print(text, file=sys.stderr, flush=True)
        os._exit(1)  # at once: rank 0 waits on this death (no slow teardown of torch)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
