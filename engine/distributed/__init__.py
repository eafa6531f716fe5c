"""Tensor parallelism: one engine over N ranks (see engine/README.md, "A step across ranks").

Rank 0 is the `EngineCore` nodes drive; `TensorParallel` is each rank's share (process group,
step broadcast, workers); `TPShard` says which kv heads a rank holds."""

from engine.distributed.parallel_layers import TPLayers
from engine.distributed.process_group import TPError
from engine.distributed.tensor_parallel import TensorParallel, WorkerInit, WorkerSpec
from engine.distributed.tp_shard import ModelPartition, TPShard, check_tp_size, partition_model

__all__ = [
    "ModelPartition", "TPError", "TPLayers", "TPShard", "TensorParallel", "WorkerInit",
    "WorkerSpec", "check_tp_size", "partition_model",
]  # fmt: skip
