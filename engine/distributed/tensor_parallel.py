"""`TensorParallel`: one rank's share of a tensor-parallel engine (what `EngineCore.tp` holds).

```
rank 0 (the engine nodes drive)              ranks 1..N-1 (python -m engine.tp_worker)
start(config, arch, worker_init):
  check the sizes divide; devices; store;
  the step broadcast (shm); WorkerGroup ───────► join(spec): device, attach the broadcast,
  wait for every worker to report "joining"         report "joining"
  TPComm (init_process_group) ◄────────────────────► TPComm
EngineCore builds the same way on every rank: its shard of the model (TPLayers), the KV pool
  at agree_num_blocks (the min over the ranks), CUDA graphs (all-reduces captured inside)
ready(): barrier (after the workers' worker_init), then the per-collective step timeout
each step: send_step(message) ─── shm ──────────► receive_step() -> the same forward
           broadcast(prev ids) (async, if any) ─► receive_tokens(n)
close(): STOP, wait, kill stragglers           ◄─ STOP: leave the loop, exit
```

Failures: a worker that dies is seen by the watcher at once (its pipe closes): the others
are killed, a blocked NCCL collective aborted, and every later call raises `TPError` naming
it; a collective that fails or times out (a rank hangs: `tp_step_timeout_s`) raises `TPError`
too, and the workers are killed. Workers never outlive rank 0 (engine/tp_worker.py).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from engine.distributed.parallel_layers import TPLayers
from engine.distributed.process_group import TPComm, TPError, connect_store, create_store
from engine.distributed.shm_broadcast import ShmBroadcast
from engine.distributed.step_message import STOP, StepMessage
from engine.distributed.tp_devices import cpu_threads_per_rank, tp_devices
from engine.distributed.tp_shard import (
    ArchShape,
    ModelPartition,
    TPShard,
    check_tp_size,
    partition_model,
)
from engine.distributed.worker_group import WorkerGroup

logger = logging.getLogger(__name__)

# Run in a worker rank's process with that rank's EngineCore, before the engine is ready:
# node code attaches what it needs there (its KV hooks); what it returns (picklable, e.g. the
# rank's KV transport address) reaches rank 0 as `TensorParallel.worker_results[rank]`.
# Picklable itself: a module-level function or a functools.partial of one.
WorkerInit = Callable[[Any], Any]
_STOP_GRACE_S = 10.0


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker rank needs to join (sent pickled over its pipe)."""

    rank: int
    world_size: int
    device: str
    partition: ModelPartition
    store_port: int
    broadcast_path: str
    start_timeout_s: float
    step_timeout_s: float
    config: Any  # pdserve.config.EngineConfig
    worker_init: WorkerInit | None
    log_level: int
    num_threads: int | None  # CPU: torch threads of this rank


class TensorParallel:
    def __init__(
        self,
        partition: ModelPartition,
        device: torch.device,
        comm: TPComm,
        broadcast: ShmBroadcast,
        timeouts_s: tuple[float, float],  # (start, step)
        workers: WorkerGroup | None = None,
        worker_hooks: bool = False,
    ) -> None:
        self.partition = partition
        self.device = device
        self.comm = comm
        self.layers = TPLayers(comm, partition)
        self.broadcast = broadcast
        self.start_timeout_s, self.step_timeout_s = timeouts_s
        self.workers = workers
        self.worker_hooks = worker_hooks  # the workers have a layer hook: ship prefill records
        self.failure: str | None = None
        # rank 0, once ready: what each worker rank's worker_init returned, by rank
        self.worker_results: dict[int, Any] = {}
        comm.diagnose = self._diagnose
        self._threads_before = torch.get_num_threads()
        self._finalizer = weakref.finalize(self, _kill, workers, broadcast, comm)
        self.closed = False

    @property
    def rank(self) -> int:
        return self.partition.rank

    @property
    def world_size(self) -> int:
        return self.partition.world_size

    @property
    def shard(self) -> TPShard:
        """Which kv heads this rank's KV pool holds (what a KV hand-off matches on)."""
        return self.partition.shard

    @classmethod
    def start(cls, config: Any, arch: ArchShape, worker_init: WorkerInit | None) -> TensorParallel:
        """Rank 0: start ranks 1..N-1 and form the group (`config`: an EngineConfig)."""
        par = config.parallel
        n, start_s = par.tensor_parallel_size, par.tp_start_timeout_s
        check_tp_size(arch, n, config.model.model)  # the sizes divide, or a clear refusal
        if config.cache.kv_offload_memory:
            raise ValueError(
                "--kv-offload-memory (the host KV tier) does not run with tensor parallelism "
                "yet: it moves rank 0's KV only, and every rank holds its own heads"
            )
        devices = tp_devices(par.devices, config.model.device, n)
        partitions = [partition_model(arch, r, n) for r in range(n)]
        threads = cpu_threads_per_rank(devices[0], n)
        if devices[0].type == "cuda":
            torch.cuda.set_device(devices[0])  # graphs, streams and events of rank 0's device
        store = create_store(n, start_s)
        broadcast = ShmBroadcast.create(n - 1)
        level, steps_s = logging.getLogger().getEffectiveLevel(), par.tp_step_timeout_s
        common = (store.port, broadcast.path, start_s, steps_s, config, worker_init, level, threads)
        specs = [WorkerSpec(r, n, str(devices[r]), partitions[r], *common) for r in range(1, n)]
        workers = None
        try:
            workers = WorkerGroup(specs)
            workers.wait_reports("joining", start_s)
            comm = TPComm(0, n, devices[0], store, start_s)
        except BaseException:
            _kill(workers, broadcast)
            raise
        broadcast.unlink()  # every worker attached before it joined
        tp = cls(partitions[0], devices[0], comm, broadcast, (start_s, par.tp_step_timeout_s),
                 workers, worker_hooks=worker_init is not None)  # fmt: skip
        workers.on_failure = comm.abort
        if threads is not None:
            torch.set_num_threads(threads)
        logger.info(
            "tensor parallel: %d ranks on %s (%s), worker pids %s, kv heads per rank %d%s",
            n, ",".join(map(str, devices)), comm.backend, workers.pids,
            tp.shard.num_kv_heads, " (replicated)" if tp.shard.replicated else "",
        )  # fmt: skip
        return tp

    @classmethod
    def join(cls, spec: WorkerSpec, on_joining: Callable[[], None]) -> TensorParallel:
        """A worker rank: attach the step broadcast and join rank 0's group."""
        device = torch.device(spec.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if spec.num_threads is not None:
            torch.set_num_threads(spec.num_threads)
        broadcast = ShmBroadcast.attach(spec.broadcast_path, spec.world_size - 1, spec.rank - 1)
        store = connect_store(spec.store_port, spec.world_size, spec.start_timeout_s)
        on_joining()
        comm = TPComm(spec.rank, spec.world_size, device, store, spec.start_timeout_s)
        return cls(spec.partition, device, comm, broadcast,
                   (spec.start_timeout_s, spec.step_timeout_s))  # fmt: skip

    # ---- start ----------------------------------------------------------------------------

    def agree_num_blocks(self, num_blocks: int) -> int:
        """The KV pool size every rank can hold: the smallest of theirs (block ids are rank
        0's, the same on every rank)."""
        agreed = self.comm.min_int(num_blocks)
        if agreed < num_blocks:
            logger.info("KV pool: %d blocks (another rank holds fewer than %d)", agreed, num_blocks)
        return agreed

    def attach(self, runner: Any) -> None:
        """Rank 0, once its engine is built: `runner` (its ModelRunner) publishes each step
        to the other ranks; waits until every rank is `ready`. Worker ranks: nothing (their
        entry point calls `ready` after its worker_init)."""
        if self.rank == 0:
            runner.tp = self
            self.ready()

    def ready(self) -> None:
        """Every rank built its engine (and ran its worker_init): from now on a collective
        that waits longer than the step timeout means a rank hangs. Rank 0 then holds what
        each worker's worker_init returned (`worker_results`)."""
        self.comm.barrier()
        self.comm.set_timeout(self.step_timeout_s)
        if self.workers is not None:  # each sent its result before the barrier
            self.worker_results = self.workers.wait_reports("ready", self.start_timeout_s)

    # ---- steps ----------------------------------------------------------------------------

    def send_step(self, message: StepMessage, prev_tokens: torch.Tensor | None) -> None:
        """Rank 0: hand this step's inputs to the other ranks (then the previous step's
        sampled ids, on the device, when its PENDING decodes read them)."""
        self.check()
        try:
            self.broadcast.write(message.encode(), self.step_timeout_s, self.check)
        except TimeoutError:
            raise self._diagnose(TimeoutError("a rank took no step message")) from None
        if prev_tokens is not None:
            self.comm.broadcast(prev_tokens)

    def receive_step(self) -> StepMessage | None:
        """A worker: the next step's message (None: stop)."""
        return StepMessage.decode(self.broadcast.read())

    def receive_tokens(self, num_tokens: int) -> torch.Tensor:
        """A worker: rank 0's previous sampled ids (see send_step)."""
        ids = torch.empty(num_tokens, dtype=torch.int64, device=self.device)
        return self.comm.broadcast(ids)

    # ---- failures and shutdown ------------------------------------------------------------

    def check(self) -> None:
        """Raise TPError if a rank died, hung or failed (rank 0)."""
        if self.failure is None and self.workers is not None:
            self.failure = self.workers.failure
        if self.failure is not None:
            raise TPError(self.failure)

    def _diagnose(self, error: BaseException) -> TPError:
        """The TPError for a failed collective: the worker that died, if the watcher saw one
        (it may see it just after the collective failed), else the timeout or failure."""
        failure = self.workers.wait_failure(5.0) if self.workers is not None else None
        if failure is None:
            failure = (
                f"a tensor-parallel collective on rank {self.rank} failed or timed out (a rank "
                f"hangs past tp_step_timeout_s={self.step_timeout_s:g} s, or died): {error}"
            )
        if self.workers is not None:
            self.workers.kill()
        self.failure = self.failure or failure
        return TPError(self.failure)

    def close(self) -> None:
        """Stop the workers (rank 0), leave the group. Idempotent."""
        if self.closed:
            return
        self.closed = True
        if self.workers is not None:
            if self.failure is None and self.workers.failure is None:
                try:
                    self.broadcast.write(STOP, 2.0)
                except TimeoutError:
                    logger.warning("a tensor-parallel rank took no STOP: killing it")
            self.workers.stop(_STOP_GRACE_S)
            torch.set_num_threads(self._threads_before)
        self.comm.destroy()
        self.broadcast.close()
        self._finalizer.detach()


def _kill(workers: WorkerGroup | None, broadcast: ShmBroadcast, comm: TPComm | None = None) -> None:
    """Nothing left behind when start fails or nobody closed the engine (its group left too,
    so this process may start another)."""
    if workers is not None:
        workers.stop(0.0)
    broadcast.unlink()
    if comm is not None:
        comm.destroy()
