"""Block gather/scatter kernels for moving one layer's K and V of a request (KV hand-off)."""

from kernels.kv_copy.block_copy import gather_blocks, scatter_blocks, triton_available

__all__ = ["gather_blocks", "scatter_blocks", "triton_available"]
