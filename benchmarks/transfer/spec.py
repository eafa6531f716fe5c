"""`TransferSpec`: the synthetic request `pd-bench transfer` moves, shared by both processes.

Both ends derive the prefill side's KV from the same seed, so the decode side can check what
landed byte for byte without the bytes crossing twice: one random layer (`base`, drawn on the
host, identical on every machine) and every layer `i` is `base` rotated by a layer-dependent
number of bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cache_transfer import KVLayout

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


def layout_for(model: str, dtype: str = "bfloat16", block_size: int = 16) -> KVLayout:
    """The KV layout of a named model shape ("llama3-8b", "synthetic:qwen3-8b:layers=4")."""
    from engine.model.synthetic import PREFIX, parse_synthetic

    name = model if model.startswith(PREFIX) else PREFIX + model
    arch = parse_synthetic(name)
    return KVLayout(model=name, block_size=block_size, dtype=dtype, **arch.layout_fields())


@dataclass(frozen=True)
class TransferSpec:
    """One request's KV: `num_tokens` tokens out of pools of `num_pool_blocks` blocks."""

    layout: KVLayout
    num_tokens: int
    transport: str
    seed: int = 0
    in_place: bool = False  # CUDA, one GPU: the sender writes into the receiver's pool (IPC)

    @property
    def num_blocks(self) -> int:
        return self.layout.num_blocks_for(self.num_tokens)

    @property
    def num_pool_blocks(self) -> int:
        """Room for the request's blocks to sit at random ids on both sides."""
        return self.num_blocks + max(1, self.num_blocks // 4)

    @property
    def layer_bytes(self) -> int:
        return self.layout.layer_bytes(self.num_blocks)

    @property
    def request_bytes(self) -> int:
        return self.layer_bytes * self.layout.num_layers

    def describe(self) -> str:
        layout = self.layout
        return (
            f"{layout.model}: {layout.num_layers} layers x {layout.num_kv_heads} kv heads x "
            f"{layout.head_dim} ({layout.dtype}, block {layout.block_size}), {self.num_tokens} "
            f"tokens: {self.layer_bytes / 2**20:.1f} MiB/layer, "
            f"{self.request_bytes / 2**20:.1f} MiB/request"
        )

    def base_layer(self, device: torch.device) -> torch.Tensor:
        """The random bytes of one layer's pool, K then V: `[2 * num_pool_blocks * block]`."""
        num_bytes = self.num_pool_blocks * self.layout.bytes_per_block
        gen = torch.Generator().manual_seed(self.seed)
        return torch.randint(0, 256, (num_bytes,), dtype=torch.uint8, generator=gen).to(device)

    def src_layer(self, base: torch.Tensor, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The prefill side's (k_cache, v_cache) of layer `layer_idx`, each `[num_pool_blocks,
        block_size, num_kv_heads, head_dim]`."""
        rotated = torch.roll(base, shifts=4099 * layer_idx + 1)
        k_bytes, v_bytes = rotated.view(2, -1)
        shape = (self.num_pool_blocks, *self.layout.block_shape)
        dtype = self.layout.torch_dtype
        return k_bytes.view(dtype).view(shape), v_bytes.view(dtype).view(shape)

    def src_caches(self, device: torch.device) -> KVCaches:
        base = self.base_layer(device)
        return [self.src_layer(base, i) for i in range(self.layout.num_layers)]

    def empty_caches(self, device: torch.device) -> KVCaches:
        """Zeroed caches, views of one allocation as the engine's pool (what writes in place
        export)."""
        layout = self.layout
        shape = (layout.num_layers, 2, self.num_pool_blocks, *layout.block_shape)
        pool = torch.zeros(shape, dtype=layout.torch_dtype, device=device)
        return [(pool[i, 0], pool[i, 1]) for i in range(layout.num_layers)]


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (nothing to wait for on the host)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
