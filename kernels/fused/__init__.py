"""The fused per-layer ops of the Llama forward (residual add + RMSNorm, rotary on q and k,
SwiGLU): a torch reference and Triton kernels, picked once per model by `get_layer_ops`."""

from kernels.fused.layer_ops import REFERENCE_OPS, LayerOps, get_layer_ops, with_packed_linear

__all__ = ["REFERENCE_OPS", "LayerOps", "get_layer_ops", "with_packed_linear"]
