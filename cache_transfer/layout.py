"""`KVLayout`: the shape of a model's paged KV cache, compared by both ends of a transfer."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from cache_transfer.suffix import KVSuffix

KVCaches = Sequence[tuple[torch.Tensor, torch.Tensor]]  # per layer: (k_cache, v_cache)

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "fp8_e4m3": torch.float8_e4m3fn,  # --kv-cache-dtype fp8_e4m3 (fixed per-head scales)
}


@dataclass(frozen=True)
class KVLayout:
    """Per-layer cache `k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]`."""

    model: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str  # "float32" | "float16" | "bfloat16" | "fp8_e4m3" (the cache's storage)

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"KVLayout.dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")

    @classmethod
    def from_dtype(cls, dtype: torch.dtype, **fields: object) -> KVLayout:
        """Build from a torch dtype instead of its name."""
        names = {v: k for k, v in _DTYPES.items()}
        if dtype not in names:
            raise ValueError(f"unsupported KV cache dtype {dtype}; use one of {sorted(_DTYPES)}")
        return cls(dtype=names[dtype], **fields)  # type: ignore[arg-type]

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def block_shape(self) -> tuple[int, int, int]:
        """Shape of one block of one of K or V: (block_size, num_kv_heads, head_dim)."""
        return (self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block of one layer, K and V together."""
        itemsize = self.torch_dtype.itemsize
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * itemsize

    def layer_bytes(self, num_blocks: int) -> int:
        """Bytes of one packed layer of a request holding `num_blocks` blocks."""
        return num_blocks * self.bytes_per_block

    def kv_bytes(self, num_blocks: int) -> int:
        """Bytes of `num_blocks` blocks in every layer."""
        return self.layer_bytes(num_blocks) * self.num_layers

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def with_heads(self, num_kv_heads: int) -> KVLayout:
        """This layout over `num_kv_heads` of the kv heads (a tensor-parallel session carries a
        slice of them: `HeadSlice`)."""
        return dataclasses.replace(self, num_kv_heads=num_kv_heads)

    def layout_hash(self) -> str:
        """Stable sha256 hex of the fields: equal hashes mean byte-compatible caches."""
        canonical = json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()


def dtype_mismatch(src_dtype: str, dst_dtype: str) -> str | None:
    """The refusal naming two different KV cache dtypes (sender's first), or None when they
    agree or one is unknown ("": an older peer)."""
    if not src_dtype or not dst_dtype or src_dtype == dst_dtype:
        return None
    return (
        f"kv cache dtype {src_dtype} vs {dst_dtype} (the prefill node's vs the decode node's): "
        "start both with the same --kv-cache-dtype (and --dtype)"
    )


@dataclass(frozen=True)
class HeadSlice:
    """Which kv heads of the model one session carries, `[kv_head_start, kv_head_end)`, and who
    sends them: rank `rank` of a node of `tp_size` ranks (cache_transfer/tp/). A TP 1 hand-off
    carries every head: `HeadSlice.whole(num_kv_heads)`."""

    kv_head_start: int
    kv_head_end: int  # exclusive
    tp_size: int = 1
    rank: int = 0

    @classmethod
    def whole(cls, num_kv_heads: int) -> HeadSlice:
        return cls(0, num_kv_heads)

    @property
    def num_kv_heads(self) -> int:
        return self.kv_head_end - self.kv_head_start

    def describe(self) -> str:
        return (
            f"kv heads [{self.kv_head_start}, {self.kv_head_end}) from rank {self.rank} of "
            f"{self.tp_size}"
        )


def kv_device_id(device: torch.device) -> str:
    """A name for the physical device a KV cache lives on, the same in every process of the
    host: "GPU-<uuid>" for a CUDA device, "" for the CPU."""
    if device.type != "cuda":
        return ""
    return f"GPU-{torch.cuda.get_device_properties(device).uuid}"


def check_reservation(pool_size: int, dst_block_ids: Sequence[int], suffix: KVSuffix) -> None:
    """ValueError unless `dst_block_ids` (distinct, in a pool of `pool_size` blocks) hold the
    KV `suffix` says a hand-off carries."""
    needed = suffix.num_blocks
    if len(dst_block_ids) < needed:
        raise ValueError(
            f"{suffix.num_tokens} tokens ({suffix.num_cached_blocks} blocks held) need "
            f"{needed} blocks of {suffix.block_size}; only {len(dst_block_ids)} dst_block_ids "
            "were reserved"
        )
    if len(set(dst_block_ids)) != len(dst_block_ids):
        raise ValueError(f"dst_block_ids must be distinct, got {list(dst_block_ids)}")
    bad = [b for b in dst_block_ids if not 0 <= b < pool_size]
    if bad:
        raise ValueError(f"dst_block_ids {bad[:8]} are outside the cache's [0, {pool_size}) blocks")
