"""Each rank loads exactly its slice of every tensor (engine/model/shard_loading.py): from
safetensors (a Hugging Face folder; a GGUF's converted folder is one) and for synthetic
weights, the values the whole model has there."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.distributed import ModelPartition
from engine.model.arch_config import ModelArchConfig
from tests.unit.engine.distributed.tp_models import build_biased_llama, load_rank, load_whole


def expected_slice(
    whole: torch.Tensor, name: str, part: ModelPartition, arch: ModelArchConfig
) -> torch.Tensor:
    """What rank `part` must hold of the whole model's parameter `name` (fused names)."""
    d, inter = arch.head_dim, arch.intermediate_size
    q_size, kv_size = arch.num_heads * d, arch.num_kv_heads * d
    heads = slice(part.head_start * d, part.head_end * d)
    kv = slice(part.shard.kv_head_start * d, part.shard.kv_head_end * d)
    cols = slice(part.intermediate_start, part.intermediate_end)
    if ".qkv_proj." in name:
        q, k, v = whole.split([q_size, kv_size, kv_size])
        return torch.cat([q[heads], k[kv], v[kv]])
    if ".gate_up_proj." in name:
        gate, up = whole.split([inter, inter])
        return torch.cat([gate[cols], up[cols]])
    if name.endswith("o_proj.weight"):
        return whole[:, heads]
    if name.endswith("o_proj.bias"):
        return whole if part.rank == 0 else torch.zeros_like(whole)
    if name.endswith("down_proj.weight"):
        return whole[:, cols]
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        rows = whole[part.vocab_start : part.vocab_start + part.vocab_per_rank]
        return torch.cat([rows, rows.new_zeros(part.vocab_per_rank - rows.shape[0], rows.shape[1])])
    return whole


def assert_ranks_hold_their_slices(model: str, world_size: int) -> None:
    whole = load_whole(model)
    params = dict(whole.named_parameters())
    for rank in range(world_size):
        shard, part = load_rank(model, rank, world_size)
        for name, param in shard.named_parameters():
            want = expected_slice(params[name].detach(), name, part, whole.arch)
            assert param.shape == want.shape, (name, rank)
            assert torch.equal(param, want), f"{model} rank {rank}: {name} differs"


@pytest.mark.parametrize(
    ("model", "world_size"),
    [
        ("synthetic:tiny-llama", 2),
        ("synthetic:tiny-llama", 4),  # kv heads replicated
        ("synthetic:tiny-qwen2:vocab=509", 2),  # qkv bias, tied embedding, padded vocab
        ("synthetic:tiny-qwen3", 2),  # q/k norm
    ],
)
def test_synthetic_slices_are_the_whole_models(model: str, world_size: int) -> None:
    assert_ranks_hold_their_slices(model, world_size)


@pytest.mark.parametrize(("arch", "world_size"), [("qwen2", 2), ("qwen3", 2), ("llama", 4)])
def test_safetensors_slices_are_the_checkpoints(
    tiny_checkpoints: dict[str, Path], arch: str, world_size: int
) -> None:
    assert_ranks_hold_their_slices(str(tiny_checkpoints[arch]), world_size)


def test_a_row_parallel_bias_is_held_by_rank_0_only(tmp_path: Path) -> None:
    assert_ranks_hold_their_slices(str(build_biased_llama(tmp_path / "biased")), 2)
