"""`synthetic:<shape>[:key=value,...]`: seeded random weights of a named real model shape.

```
synthetic:llama3-8b                 the full Llama-3-8B shape
synthetic:llama3-8b:layers=2        the same layers, only two of them (one-layer benchmarks)
synthetic:tiny-llama:vocab=1024     a tiny test model with a bigger vocabulary
```

Weights are drawn on the target device by a counter-based generator (a splitmix64 hash of
`(ModelConfig.seed, parameter index, element index)` in int64 arithmetic), so the same seed gives
the same weights on any device and in any process: a prefill and a decode node hold identical
models, and a CUDA run can be checked against the CPU reference. Scales keep activations O(1)
through the depth, so logits are finite, spread and input-dependent.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engine.model.arch_config import ModelArchConfig, RopeConfig

PREFIX = "synthetic:"

_LLAMA3_ROPE = RopeConfig(
    theta=500000.0,
    scaling_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=8192,
)

SHAPES: dict[str, ModelArchConfig] = {
    "llama3-8b": ModelArchConfig(
        architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096,
        intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
        max_position_embeddings=131072, rms_norm_eps=1e-5, rope=_LLAMA3_ROPE,
        torch_dtype="bfloat16", eos_token_ids=(128001, 128008, 128009), bos_token_id=128000,
    ),
    "qwen2.5-7b": ModelArchConfig(
        architecture="Qwen2ForCausalLM", vocab_size=152064, hidden_size=3584,
        intermediate_size=18944, num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128,
        max_position_embeddings=32768, rms_norm_eps=1e-6, rope=RopeConfig(theta=1000000.0),
        attention_bias=True, torch_dtype="bfloat16", eos_token_ids=(151645, 151643),
        bos_token_id=151643,
    ),
    "qwen3-8b": ModelArchConfig(
        architecture="Qwen3ForCausalLM", vocab_size=151936, hidden_size=4096,
        intermediate_size=12288, num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128,
        max_position_embeddings=40960, rms_norm_eps=1e-6, rope=RopeConfig(theta=1000000.0),
        qk_norm=True, torch_dtype="bfloat16", eos_token_ids=(151645, 151643),
        bos_token_id=151643,
    ),
    "smollm2-135m": ModelArchConfig(
        architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576,
        intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
        max_position_embeddings=8192, rms_norm_eps=1e-5, rope=RopeConfig(theta=100000.0),
        tie_word_embeddings=True, torch_dtype="bfloat16", eos_token_ids=(2,), bos_token_id=1,
    ),
    "tiny-llama": ModelArchConfig(
        architecture="LlamaForCausalLM", vocab_size=512, hidden_size=64, intermediate_size=128,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=1024,
        rms_norm_eps=1e-5, eos_token_ids=(2,), bos_token_id=1,
    ),
    "tiny-qwen2": ModelArchConfig(
        architecture="Qwen2ForCausalLM", vocab_size=512, hidden_size=64, intermediate_size=128,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=1024,
        attention_bias=True, tie_word_embeddings=True, eos_token_ids=(2,), bos_token_id=1,
    ),
    "tiny-qwen3": ModelArchConfig(
        architecture="Qwen3ForCausalLM", vocab_size=512, hidden_size=64, intermediate_size=128,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=1024,
        qk_norm=True, eos_token_ids=(2,), bos_token_id=1,
    ),
}  # fmt: skip

_LOGIT_STD = 4.0

# override key -> ModelArchConfig field (integer fields only)
OVERRIDES: dict[str, str] = {
    "layers": "num_layers",
    "vocab": "vocab_size",
    "hidden": "hidden_size",
    "intermediate": "intermediate_size",
    "heads": "num_heads",
    "kv_heads": "num_kv_heads",
    "head_dim": "head_dim",
    "max_len": "max_position_embeddings",
}


def is_synthetic(model: str) -> bool:
    return model.startswith(PREFIX)


def parse_synthetic(model: str) -> ModelArchConfig:
    """The architecture `synthetic:<shape>[:key=value,...]` names."""
    shape, *override_groups = model.removeprefix(PREFIX).split(":")
    if shape not in SHAPES:
        raise ValueError(
            f"unknown synthetic shape {shape!r} in {model!r}; known: {', '.join(SHAPES)}"
        )
    changes: dict[str, Any] = {}  # ModelArchConfig field -> its (int) value
    for item in ",".join(override_groups).split(","):
        if not item:
            continue
        key, _, value = item.partition("=")
        if key not in OVERRIDES or not value.isdigit() or int(value) <= 0:
            raise ValueError(
                f"bad synthetic override {item!r} in {model!r}: use key=<positive int> "
                f"with key one of {', '.join(OVERRIDES)}"
            )
        changes[OVERRIDES[key]] = int(value)
    arch = dataclasses.replace(SHAPES[shape], **changes)
    if arch.num_heads % arch.num_kv_heads != 0:
        raise ValueError(f"{model!r}: heads ({arch.num_heads}) must be a multiple of kv_heads")
    return arch


@dataclass(frozen=True)
class GlobalIndex:
    """Where a tensor-parallel rank's slice of a parameter sits in the whole one: `rows[i]` is
    the whole parameter's row of local row i (-1: a zero row, e.g. vocab padding), `cols[j]`
    the column of local column j (None: all of them). 1-D parameters use `rows` only."""

    shape: tuple[int, ...]  # the whole parameter's
    rows: torch.Tensor | None = None  # [local rows] int64; None: all rows
    cols: torch.Tensor | None = None  # [local cols] int64; None: all columns


# A rank's slices: (parameter name, its local tensor) -> GlobalIndex (None: the whole parameter)
ShardIndexer = Callable[[str, torch.Tensor], GlobalIndex | None]


@torch.no_grad()
def init_synthetic_weights(
    model: nn.Module, arch: ModelArchConfig, seed: int, shard: ShardIndexer | None = None
) -> None:
    """Fill every parameter in place (on its device, in its dtype), identically on any device.

    Every matrix has std 1/sqrt(fan_in), so each layer's output is O(1); projections into the
    residual stream are scaled down by the depth. Layer norms are 1 and the final norm is
    `_LOGIT_STD`, giving logits of std ~4: peaked enough that greedy picks are rarely near-ties
    that half-precision noise would flip. (Scaling the embedding instead would make tied models
    echo their last input token: its self dot product would dominate.)

    `shard` (tensor parallelism): a rank's model holds slices; each slice gets exactly the
    values the whole parameter has there (one tensor at a time, only the slice generated).
    """
    residual_scale = 1.0 / math.sqrt(2 * max(arch.num_layers, 1))
    for index, (name, param) in enumerate(model.named_parameters()):
        where = None if shard is None else shard(name, param)
        fan_in = param.shape[-1] if where is None else where.shape[-1]
        if name == "model.norm.weight":
            param.fill_(_LOGIT_STD)
        elif "norm" in name:
            param.fill_(1.0)
        elif name.endswith("bias"):
            _fill_uniform(param, 0.02, _mix(seed, index), where)
        else:
            std = 1.0 / math.sqrt(fan_in)
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                std *= residual_scale
            _fill_uniform(param, std, _mix(seed, index), where)


_MASK64 = (1 << 64) - 1
_CHUNK = 1 << 24  # elements per pass: bounds the int64 temporaries


def _signed(value: int) -> int:
    """A 64-bit pattern as the int64 torch stores."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def _mix(seed: int, index: int) -> int:
    return _signed((seed * 0x9E3779B97F4A7C15) ^ (index * 0xD1B54A32D192ED03))


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _uniform(x: torch.Tensor, key: int, half_width: float) -> torch.Tensor:
    """Uniform(-half_width, half_width) float32 of int64 element indices `x` (splitmix64)."""
    x = x * _signed(0x9E3779B97F4A7C15) + key
    x = (x ^ _shr(x, 30)) * _signed(0xBF58476D1CE4E5B9)
    x = (x ^ _shr(x, 27)) * _signed(0x94D049BB133111EB)
    x = x ^ _shr(x, 31)
    unit = _shr(x, 40).to(torch.float32) * (2.0**-24)  # in [0, 1)
    return (unit * 2.0 - 1.0) * half_width


def _fill_uniform(
    param: torch.Tensor, std: float, key: int, where: GlobalIndex | None = None
) -> None:
    """Uniform(-std*sqrt(3), std*sqrt(3)) (variance std^2) from splitmix64 of element indices
    (of the whole parameter's elements, for a slice `where`)."""
    half_width = std * math.sqrt(3.0)
    if where is not None:
        _fill_slice(param, half_width, key, where)
        return
    flat = param.view(-1)
    for start in range(0, flat.numel(), _CHUNK):
        end = min(start + _CHUNK, flat.numel())
        x = torch.arange(start, end, device=flat.device, dtype=torch.int64)
        flat[start:end] = _uniform(x, key, half_width).to(flat.dtype)


def _fill_slice(param: torch.Tensor, half_width: float, key: int, where: GlobalIndex) -> None:
    """A slice's values, a few local rows at a time (bounded temporaries)."""
    device = param.device
    num_rows = param.shape[0]
    rows = where.rows if where.rows is not None else torch.arange(num_rows)
    rows = rows.to(device)
    if param.dim() == 1:
        param.copy_(_uniform(rows.clamp(min=0), key, half_width).masked_fill(rows < 0, 0.0))
        return
    width = where.shape[1]
    cols = where.cols if where.cols is not None else torch.arange(width)
    cols = cols.to(device)
    step = max(1, _CHUNK // param.shape[1])
    for start in range(0, num_rows, step):
        block = rows[start : start + step, None]  # [r, 1] rows of the whole parameter
        x = block.clamp(min=0) * width + cols[None, :]  # [r, local cols] element indices
        values = _uniform(x, key, half_width).masked_fill(block < 0, 0.0)
        param[start : start + step] = values.to(param.dtype)
