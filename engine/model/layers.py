"""RMSNorm: the weight holder of the Llama family's norms (the forward calls the fused ops of
kernels/fused with its weight and eps; `forward` here is the reference, for direct use)."""

from __future__ import annotations

import torch
from torch import nn

from kernels.fused import reference


class RMSNorm(nn.Module):
    """RMS normalization over the last dim, computed in float32 like Hugging Face's LlamaRMSNorm.

    Works on any leading shape: [num_tokens, hidden] for the layer norms, [num_tokens,
    num_heads, head_dim] for Qwen3's per-head q/k norm.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim] -> [..., dim]
        return reference.rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
