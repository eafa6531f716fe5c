"""How a Llama-family model splits over `world_size` tensor-parallel ranks.

```
q heads        num_heads / N per rank, contiguous: rank r holds [r * H/N, (r + 1) * H/N)
kv heads       N <= num_kv_heads: num_kv_heads / N per rank, contiguous
               N >  num_kv_heads: replicated, each rank holds the one kv head its q heads use
               (kv head r * num_kv_heads // N; N / num_kv_heads ranks hold each)
MLP            intermediate_size / N columns of gate and up, the same rows of down
vocab          ceil(vocab_size / N) rows of the embedding and the LM head per rank; the last
               rank's rows past vocab_size are zero padding
```

As in vLLM, the heads must divide: `num_heads % N == 0`, and `num_kv_heads % N == 0` or
`N % num_kv_heads == 0`; otherwise `partition_model` refuses with the sizes and the sizes that
would work. `TPShard` is the part a KV hand-off between TP sizes matches on (which kv heads a
rank's pool holds); `ModelPartition` adds what loading a rank's weights needs. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class ArchShape(Protocol):
    """The sizes a partition reads (`engine.model.ModelArchConfig` has them)."""

    @property
    def num_heads(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...


@dataclass(frozen=True)
class TPShard:
    """The kv heads one rank's KV pool holds: `[kv_head_start, kv_head_end)` of the model's
    kv heads. `replicated`: the group has more ranks than kv heads, so other ranks hold the
    same head (its KV needs sending once, from any of them)."""

    rank: int
    world_size: int
    kv_head_start: int
    kv_head_end: int  # exclusive
    replicated: bool

    @property
    def num_kv_heads(self) -> int:
        return self.kv_head_end - self.kv_head_start


@dataclass(frozen=True)
class ModelPartition:
    """One rank's slices of every sharded dimension (end exclusive)."""

    shard: TPShard
    head_start: int
    head_end: int
    head_dim: int
    intermediate_start: int
    intermediate_end: int
    vocab_start: int
    vocab_per_rank: int  # rows of the embedding / LM head on every rank (padded)
    vocab_size: int  # the model's

    @property
    def rank(self) -> int:
        return self.shard.rank

    @property
    def world_size(self) -> int:
        return self.shard.world_size

    @property
    def num_heads(self) -> int:
        """This rank's q heads (the model is built with the rank's sizes: these four)."""
        return self.head_end - self.head_start

    @property
    def num_kv_heads(self) -> int:
        return self.shard.num_kv_heads

    @property
    def intermediate_size(self) -> int:
        return self.intermediate_end - self.intermediate_start


def check_tp_size(arch: ArchShape, world_size: int, model: str = "the model") -> None:
    """Raise ValueError naming the sizes when `world_size` ranks cannot split `arch`."""
    if world_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {world_size}")
    heads, kv_heads, inter = arch.num_heads, arch.num_kv_heads, arch.intermediate_size
    if (
        heads % world_size == 0
        and inter % world_size == 0
        and (kv_heads % world_size == 0 or world_size % kv_heads == 0)
    ):
        return
    fits = [n for n in range(1, 65) if _fits(arch, n)]
    raise ValueError(
        f"tensor_parallel_size {world_size} does not split {model}: it has {heads} attention "
        f"heads, {kv_heads} kv heads and an MLP of {inter}; the heads and the MLP must divide "
        f"by it, and the kv heads divide by it or it by them. Sizes that work: "
        f"{', '.join(map(str, fits))}"
    )


def _fits(arch: ArchShape, n: int) -> bool:
    kv = arch.num_kv_heads
    return (
        arch.num_heads % n == 0 and arch.intermediate_size % n == 0 and (kv % n == 0 or n % kv == 0)
    )


def partition_model(arch: ArchShape, rank: int, world_size: int) -> ModelPartition:
    """Rank `rank`'s slices of `arch` split over `world_size` ranks (see the module doc)."""
    check_tp_size(arch, world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a group of {world_size}")
    heads_per_rank = arch.num_heads // world_size
    kv_heads = arch.num_kv_heads
    if world_size <= kv_heads:
        per_rank = kv_heads // world_size
        kv_start, kv_end = rank * per_rank, (rank + 1) * per_rank
    else:
        kv_start = rank * kv_heads // world_size
        kv_end = kv_start + 1
    inter_per_rank = arch.intermediate_size // world_size
    vocab_per_rank = -(-arch.vocab_size // world_size)
    shard = TPShard(rank, world_size, kv_start, kv_end, replicated=world_size > kv_heads)
    return ModelPartition(
        shard=shard,
        head_start=rank * heads_per_rank,
        head_end=(rank + 1) * heads_per_rank,
        head_dim=arch.head_dim,
        intermediate_start=rank * inter_per_rank,
        intermediate_end=(rank + 1) * inter_per_rank,
        vocab_start=rank * vocab_per_rank,
        vocab_per_rank=vocab_per_rank,
        vocab_size=arch.vocab_size,
    )
