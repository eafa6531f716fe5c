"""Which projections take the skinny GEMM (`skinny_gemm.py`): the layer ops' `linear`,
`gated_linear` and `norm_linear` (`kernels.fused.layer_ops.with_skinny_gemm`). A launch is taken
only for an (M, N, K) where one measured faster than cuBLAS (`skinny_config`); everything else
stays on F.linear. Every choice is made on shapes and dtypes only: host-side and CUDA-graph safe
(a captured batch size always takes the same path)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels import pdl
from kernels.gemm.skinny_config import fused_config, measured_win
from kernels.gemm.skinny_gemm import skinny_linear, skinny_norm_linear


def _takes_skinny(x: torch.Tensor, weight: torch.Tensor, max_m: int) -> bool:
    """1..max_m rows of float16/bfloat16, K contiguous in x and weight: the skinny GEMM's
    inputs (decided on shapes and dtypes only: host-side, CUDA-graph safe)."""
    return (
        x.dim() == 2
        and 1 <= x.shape[0] <= max_m
        and x.dtype in (torch.float16, torch.bfloat16)
        and x.stride(-1) == 1
        and weight.stride(-1) == 1
    )


def routed_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, max_m: int
) -> torch.Tensor:
    """nn.Linear's projection: the skinny GEMM for 1..max_m rows of float16/bfloat16 with
    contiguous K where it measured faster than cuBLAS for this very (M, N, K) (`measured_win`,
    with its PDL-chain wins where the launch goes with PDL), else F.linear (cuBLAS). The choice
    is on shapes and dtypes only (host-side, CUDA-graph safe: a captured batch size always
    takes the same path)."""
    if _takes_skinny(x, weight, max_m):
        m = x.shape[0]
        config = measured_win(m, weight.shape[0], weight.shape[1], chained=pdl.uses_pdl(m))
        if config is not None:
            return skinny_linear(x, weight, bias, config)
    return F.linear(x, weight, bias)


def routed_gated_linear(
    gate_up: torch.Tensor,  # [M, 2K]: gate | up
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,
    *,
    max_m: int,
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """The MLP's down projection of silu_and_mul(gate_up): one gated skinny GEMM launch where
    a launch for this (M, N, K) is known (`fused_config`), else `silu_and_mul` then the
    projection (`routed_linear`). The same values either way (the kernel rounds the SwiGLU
    where silu_and_mul does)."""
    if _takes_skinny(gate_up, weight, max_m):
        config = fused_config(gate_up.shape[0], weight.shape[0], weight.shape[1])
        if config is not None:
            return skinny_linear(gate_up, weight, bias, config, gated=True)
    return routed_linear(silu_and_mul(gate_up), weight, bias, max_m=max_m)


def routed_norm_linear(
    x: torch.Tensor | None,  # [M, K] added to the residual first; None: the norm only
    residual: torch.Tensor,  # [M, K]
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    max_m: int,
) -> tuple[torch.Tensor, torch.Tensor] | None:  # (y, the residual after the add)
    """linear(rms_norm(x + residual)) and x + residual in one skinny_norm_linear launch where
    a launch for this (M, N, K) is known (`fused_config`) and does not split K; None elsewhere (the caller,
    LayerOps.normed_projection, then runs the norm op and the projection)."""
    if (
        _takes_skinny(residual, weight, max_m)
        and norm_weight.dtype == residual.dtype
        and (x is None or x.stride(-1) == 1)
    ):
        config = fused_config(residual.shape[0], weight.shape[0], weight.shape[1])
        if config is not None and config.split_k == 1:  # the norm needs all of K in a program
            return skinny_norm_linear(x, residual, norm_weight, eps, weight, bias, config)
    return None
