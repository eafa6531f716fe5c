"""`LayerOps`: the fused per-layer ops a model calls, and which implementation runs.

```
attention backend "triton" or "flash_attn", on CUDA, triton installed -> the Triton kernels
anything else (CPU, the "torch" reference backend)                    -> the torch reference
linear (the projections): F.linear (cuBLAS); with the Triton kernels and skinny_gemm_max_m > 0,
  the skinny GEMM (kernels/gemm) for steps of 1..skinny_gemm_max_m tokens in fp16/bf16, the
  MLP's down projection then with the SwiGLU in its loads (down_projection: one launch, not two)
  and QKV / gate_up with the residual add + RMSNorm before them (normed_projection: one, not two);
  bf16 on a CPU with bf16 instructions: oneDNN on weights packed at load (with_packed_linear,
  kernels/gemm/cpu_packed.py)
```

Both compute the same values (the kernels round where the reference rounds); the reference on
CPU is bit-identical to the unfused module code.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from types import ModuleType

import torch
import torch.nn.functional as F

from kernels.fused import reference
from kernels.gemm import MAX_M, cpu_packed

# Backends that already run Triton/CUDA kernels; "torch" stays the all-reference path.
_FUSED_BACKENDS = ("triton", "flash_attn")


@dataclass(frozen=True)
class LayerOps:
    name: str  # "reference" | "triton"
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    # (x, residual, weight, eps) -> (rms_norm(x + residual), x + residual)
    add_rms_norm: Callable[
        [torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]
    ]
    # (q, k, cos, sin) -> (q, k) rotated (the Triton kernel rotates in place)
    rotary_qk: Callable[
        [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]
    ]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    # (q, k, v, cos, sin, k_cache, v_cache, slot_mapping) -> (q, k) rotated, with the rotated
    # k and v stored at their cache slots (the attention backend is then told kv_written)
    rotary_qk_write_kv: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    # (x [T, K], weight [N, K], bias [N] | None) -> [T, N]: nn.Linear's projection
    linear: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor] = F.linear
    # (gate_up [T, 2K], weight [N, K], bias) -> linear(silu_and_mul(gate_up)) in one launch
    # where the skinny GEMM runs; None: the two ops (see down_projection)
    gated_linear: Callable[..., torch.Tensor] | None = None
    # (x | None, residual, norm_weight, eps, weight, bias) -> (y, residual) in one launch, or
    # None where it has no launch for the shape; the field None: always the two ops
    norm_linear: Callable[..., tuple[torch.Tensor, torch.Tensor] | None] | None = None

    def down_projection(
        self, gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """The MLP's down projection of the SwiGLU of gate_up ([T, 2K] -> [T, N])."""
        if self.gated_linear is not None:
            return self.gated_linear(gate_up, weight, bias)
        return self.linear(self.silu_and_mul(gate_up), weight, bias)

    def normed_projection(
        self,
        x: torch.Tensor | None,  # [T, K]: the block output the norm adds first; None: no add
        residual: torch.Tensor,  # [T, K]
        norm_weight: torch.Tensor,
        eps: float,
        weight: torch.Tensor,  # [N, K]
        bias: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (linear(rms_norm(x + residual)), x + residual)
        """A pre-norm block's input: the residual add, the RMSNorm and the projection after it."""
        if self.norm_linear is not None:
            fused = self.norm_linear(x, residual, norm_weight, eps, weight, bias)
            if fused is not None:
                return fused
        if x is None:
            normed = self.rms_norm(residual, norm_weight, eps)
        else:
            normed, residual = self.add_rms_norm(x, residual, norm_weight, eps)
        return self.linear(normed, weight, bias), residual


def _ops_of(name: str, module: ModuleType) -> LayerOps:
    """The LayerOps whose functions are `module`'s functions of the same names."""
    return LayerOps(
        name=name,
        rms_norm=module.rms_norm,
        add_rms_norm=module.add_rms_norm,
        rotary_qk=module.rotary_qk,
        silu_and_mul=module.silu_and_mul,
        rotary_qk_write_kv=module.rotary_qk_write_kv,
    )


REFERENCE_OPS = _ops_of("reference", reference)


def triton_ops() -> LayerOps:
    """The Triton kernels (imported on first use: triton is optional)."""
    return _ops_of("triton", importlib.import_module("kernels.fused.triton_ops"))


def with_skinny_gemm(ops: LayerOps, max_m: int) -> LayerOps:
    """`ops` whose projections of 1..max_m tokens (fp16/bf16) run on the skinny GEMM."""
    if not 1 <= max_m <= MAX_M:
        raise ValueError(f"the skinny GEMM takes steps of 1..{MAX_M} tokens, got max_m={max_m}")
    skinny = importlib.import_module("kernels.gemm.skinny_routing")
    return dataclasses.replace(
        ops,
        name=f"{ops.name}+skinny_gemm(M<={max_m})",
        linear=partial(skinny.routed_linear, max_m=max_m),
        gated_linear=partial(
            skinny.routed_gated_linear, max_m=max_m, silu_and_mul=ops.silu_and_mul
        ),
        norm_linear=partial(skinny.routed_norm_linear, max_m=max_m),
    )


def with_packed_linear(ops: LayerOps) -> LayerOps:
    """`ops` whose projections take weights packed by `cpu_packed.pack_projections`."""
    return dataclasses.replace(ops, name=f"{ops.name}+onednn_packed", linear=cpu_packed.linear)


def get_layer_ops(
    attention_backend: str, device: torch.device, skinny_gemm_max_m: int = 0
) -> LayerOps:
    """The ops for a model on `device` with the named (resolved) attention backend; with the
    Triton kernels, `skinny_gemm_max_m` > 0 routes small steps' projections to the skinny GEMM
    (PDSERVE_SKINNY_GEMM_MAX_M; off by default)."""
    if (
        torch.device(device).type == "cuda"
        and attention_backend in _FUSED_BACKENDS
        and importlib.util.find_spec("triton") is not None
    ):
        ops = triton_ops()
        return with_skinny_gemm(ops, skinny_gemm_max_m) if skinny_gemm_max_m else ops
    return REFERENCE_OPS
