"""bf16 projections on CPU through oneDNN with weights packed once at load.

`F.linear` in bf16 on CPU already runs oneDNN (AMX or AVX512-BF16 where the CPU has them), but
it reorders the weight into oneDNN's blocked layout on every call: at decode sizes that costs
about as much as the multiply. Packing each projection's weight once (`_reorder_linear_weight`,
what torch.compile's CPU freezing does) and calling `_linear_pointwise` on the packed weight
computes the same kernel without the reorder: 24-30% less time for smollm2-135m's projections
at 1..32 tokens (benchmarks/results/2026-12-05-cpu-bf16-kernels.txt).

```
pack_projections(model)       every nn.Linear weight -> its packed (opaque oneDNN) tensor;
                              the tied LM head gets a packed copy of the embedding
linear(x, weight, bias)       _linear_pointwise on a packed weight, F.linear on any other
```

Only for bfloat16 on a CPU with bf16 instructions (`supported`): fp32 keeps F.linear (MKL),
whose results the CPU exactness tests against transformers rely on, and oneDNN's fp32 kernels
round differently. A packed tensor keeps its shape, dtype and numel; it has no storage (no
`data_ptr`, no views), so only `linear` may read it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# The batch size oneDNN packs for: a hint, the layout serves any number of rows. Packed with
# it, the projections ran faster than F.linear at 1, 20 and 32 rows (bench_cpu_kernels); prefill
# sizes were measured only inside the engine's whole workload, which got faster too.
_PACK_FOR_ROWS = 32


def supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether packed projections apply: bf16 on a CPU with AMX-BF16 or AVX512-BF16, and a
    torch whose oneDNN has the packed linear ops."""
    if torch.device(device).type != "cpu" or dtype != torch.bfloat16:
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    ops = torch.ops.mkldnn
    if not (hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")):
        return False
    return native_bf16()


def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AMX tiles or AVX512-BF16)."""
    checks = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in checks)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] bf16 -> the same weight in oneDNN's packed layout (an opaque tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), _PACK_FOR_ROWS)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T + bias: the packed kernel for a packed weight, F.linear otherwise."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def pack_projections(model: nn.Module) -> int:
    """Replace every nn.Linear weight of `model` by its packed form, in place; returns how
    many. The caller routes the projections through `linear`."""
    count = 0
    for module in model.modules():
        if isinstance(module, nn.Linear) and not module.weight.is_mkldnn:
            module.weight = nn.Parameter(pack(module.weight), requires_grad=False)
            count += 1
    return count
