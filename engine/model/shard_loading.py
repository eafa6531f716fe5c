"""What one tensor-parallel rank reads of a checkpoint: its slice of each tensor, never more.

```
Hugging Face tensor                    the rank's slice (engine/distributed ModelPartition)
*.q_proj.weight | .bias                rows of its q heads
*.k_proj.*, *.v_proj.*                 rows of its kv heads (the same on ranks sharing a head)
*.o_proj.weight                        columns of its q heads; .bias: rank 0 whole, others 0
*.gate_proj.weight, *.up_proj.weight   rows [intermediate_start, intermediate_end)
*.down_proj.weight                     columns [intermediate_start, intermediate_end)
model.embed_tokens.weight, lm_head.weight   vocab_per_rank rows from vocab_start (zero rows
                                       past the vocab on the last rank)
everything else (norms)                whole
```

safetensors (and a GGUF's converted folder) are read through `safe_open(...).get_slice`: only
the slice's bytes. `synthetic:` weights are generated for the slice only, with the values the
whole model has there (`synthetic_indexer`), so TP N computes what TP 1 does.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from engine.distributed import ModelPartition
from engine.model.arch_config import ModelArchConfig
from engine.model.synthetic import GlobalIndex, ShardIndexer


@dataclass(frozen=True)
class TensorSlice:
    dim: int | None  # None: the whole tensor
    start: int = 0
    stop: int = 0
    rows: int | None = None  # pad with zero rows to this many (vocab)
    zeros: bool = False  # the rank holds zeros of the tensor's shape (a row-parallel bias)


_WHOLE = TensorSlice(None)


def tensor_slice(name: str, part: ModelPartition) -> TensorSlice:
    """Rank `part`'s slice of the checkpoint tensor `name`."""
    d = part.head_dim
    leaf = ".".join(name.split(".")[-2:])  # "q_proj.weight"
    if leaf in ("q_proj.weight", "q_proj.bias"):
        return TensorSlice(0, part.head_start * d, part.head_end * d)
    if leaf in ("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias"):
        return TensorSlice(0, part.shard.kv_head_start * d, part.shard.kv_head_end * d)
    if leaf == "o_proj.weight":
        return TensorSlice(1, part.head_start * d, part.head_end * d)
    if leaf == "o_proj.bias":
        return _WHOLE if part.rank == 0 else TensorSlice(None, zeros=True)
    if leaf in ("gate_proj.weight", "up_proj.weight"):
        return TensorSlice(0, part.intermediate_start, part.intermediate_end)
    if leaf == "down_proj.weight":
        return TensorSlice(1, part.intermediate_start, part.intermediate_end)
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        stop = min(part.vocab_start + part.vocab_per_rank, part.vocab_size)
        return TensorSlice(0, part.vocab_start, stop, rows=part.vocab_per_rank)
    return _WHOLE


def iter_safetensors_shard(
    model_dir: Path, files: list[str], part: ModelPartition
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, the rank's slice as a CPU tensor) of every tensor in `files` of `model_dir`."""
    for file_name in files:
        with safe_open(model_dir / file_name, framework="pt", device="cpu") as tensors:
            for name in tensors.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, _read_slice(tensors, name, tensor_slice(name, part))


def _read_slice(tensors: object, name: str, where: TensorSlice) -> torch.Tensor:
    if where.dim is None and not where.zeros:
        return tensors.get_tensor(name)  # type: ignore[attr-defined,no-any-return]
    lazy = tensors.get_slice(name)  # type: ignore[attr-defined]
    if where.zeros:
        return torch.zeros(lazy.get_shape(), dtype=_dtype(lazy.get_dtype()))
    part = lazy[where.start : where.stop] if where.dim == 0 else lazy[:, where.start : where.stop]
    if where.rows is not None and part.shape[0] < where.rows:
        pad = part.new_zeros((where.rows - part.shape[0], *part.shape[1:]))
        part = torch.cat([part, pad])
    return part  # type: ignore[no-any-return]


def _dtype(name: str) -> torch.dtype:
    """A safetensors dtype name ("F32", "BF16", ...) as torch's."""
    table = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
             "F64": torch.float64}  # fmt: skip
    return table.get(name, torch.float32)


def synthetic_indexer(arch: ModelArchConfig, part: ModelPartition) -> ShardIndexer:
    """Where each parameter of a rank's model (fused names: qkv_proj, gate_up_proj) sits in
    the whole model's, for `init_synthetic_weights`."""
    d, hidden, inter = arch.head_dim, arch.hidden_size, arch.intermediate_size
    q_size, kv_size = arch.num_heads * d, arch.num_kv_heads * d

    def span(where: TensorSlice, offset: int = 0) -> torch.Tensor:
        return torch.arange(where.start, where.stop) + offset

    def index(name: str, param: torch.Tensor) -> GlobalIndex | None:
        module = name.rsplit(".", 2)[-2] if "." in name else name
        kind = name.rsplit(".", 1)[-1]  # weight | bias
        if module == "qkv_proj":
            q, kv = (tensor_slice(f"x.{m}_proj.{kind}", part) for m in ("q", "k"))
            rows = torch.cat([span(q), span(kv, q_size), span(kv, q_size + kv_size)])
            return GlobalIndex((q_size + 2 * kv_size, hidden)[: param.dim()], rows)
        if module == "gate_up_proj":
            g = tensor_slice("x.gate_proj.weight", part)
            return GlobalIndex((2 * inter, hidden), torch.cat([span(g), span(g, inter)]))
        if name.endswith("o_proj.bias"):  # rank 0's is the whole bias, the others' zeros
            return None if part.rank == 0 else GlobalIndex((hidden,), torch.full((hidden,), -1))
        where = tensor_slice(name, part)
        if where.dim is None:
            return None
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            rows = torch.arange(part.vocab_start, part.vocab_start + part.vocab_per_rank)
            rows = rows.masked_fill(rows >= arch.vocab_size, -1)  # padding: zero rows
            return GlobalIndex((arch.vocab_size, hidden), rows)
        whole = (hidden, q_size) if module == "o_proj" else (hidden, inter)
        return GlobalIndex(whole, cols=span(where))  # o_proj, down_proj: columns

    return index
