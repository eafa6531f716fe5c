"""The host-memory tier under the prefix cache (`--kv-offload-memory`): evicted blocks demoted
to host memory, host hits promoted back before the step that reads them (see engine/README.md,
"Host-memory tier")."""

from engine.kv_offload.block_mover import KVBlockMover
from engine.kv_offload.host_block_manager import HostBlockManager
from engine.kv_offload.host_kv_pool import HostKVPool
from engine.kv_offload.kv_offload import KVOffload, KVOffloadStats
from engine.kv_offload.offload_commands import OffloadCommands

__all__ = [
    "HostBlockManager",
    "HostKVPool",
    "KVBlockMover",
    "KVOffload",
    "KVOffloadStats",
    "OffloadCommands",
]
