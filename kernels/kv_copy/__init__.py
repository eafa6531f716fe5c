"""Block gather/scatter/copy kernels for moving one layer's K and V of a request (KV hand-off)."""

from kernels.kv_copy.block_copy import (
    copy_blocks,
    copy_blocks_layers,
    gather_blocks,
    layers_table,
    scatter_blocks,
    triton_available,
)

__all__ = [
    "copy_blocks",
    "copy_blocks_layers",
    "gather_blocks",
    "layers_table",
    "scatter_blocks",
    "triton_available",
]
