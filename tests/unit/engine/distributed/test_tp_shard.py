"""How a model splits over tensor-parallel ranks (engine/distributed/tp_shard.py)."""

from __future__ import annotations

import pytest

from engine.distributed import check_tp_size, partition_model
from engine.model.synthetic import SHAPES, parse_synthetic

SPLITS = [
    ("synthetic:tiny-llama", 2),  # 4 heads, 2 kv heads: one kv head each
    ("synthetic:tiny-llama", 4),  # more ranks than kv heads: replicated
    ("synthetic:llama3-8b", 8),
    ("synthetic:llama3-8b", 16),  # 8 kv heads over 16 ranks
    ("synthetic:qwen2.5-7b", 4),  # 28 heads, 4 kv heads
    ("synthetic:smollm2-135m", 3),  # 9 heads, 3 kv heads
]


@pytest.mark.parametrize(("model", "world_size"), SPLITS)
def test_each_rank_holds_the_kv_heads_its_q_heads_use(model: str, world_size: int) -> None:
    arch = parse_synthetic(model)
    group = arch.num_heads // arch.num_kv_heads  # q heads per kv head
    parts = [partition_model(arch, r, world_size) for r in range(world_size)]
    q_heads = [h for p in parts for h in range(p.head_start, p.head_end)]
    assert q_heads == list(range(arch.num_heads))  # every q head once, in order
    for p in parts:
        for head in range(p.head_start, p.head_end):
            assert p.shard.kv_head_start <= head // group < p.shard.kv_head_end
        assert p.shard.replicated == (world_size > arch.num_kv_heads)
        assert p.num_kv_heads == p.shard.num_kv_heads and p.num_heads * world_size == arch.num_heads
    kv_heads = {h for p in parts for h in range(p.shard.kv_head_start, p.shard.kv_head_end)}
    assert kv_heads == set(range(arch.num_kv_heads))


@pytest.mark.parametrize(
    ("model", "world_size"),
    [("llama3-8b", 1), ("llama3-8b", 2), ("llama3-8b", 8), ("smollm2-135m", 3)],
)
def test_the_vocab_and_the_mlp_are_covered_once(model: str, world_size: int) -> None:
    arch = parse_synthetic(f"synthetic:{model}:vocab=509")  # 509: a padded last slice
    parts = [partition_model(arch, r, world_size) for r in range(world_size)]
    vocab = [v for p in parts for v in range(p.vocab_start, p.vocab_start + p.vocab_per_rank)]
    assert vocab[: arch.vocab_size] == list(range(arch.vocab_size))
    assert len(vocab) - arch.vocab_size < world_size  # padding: under one row per rank
    inter = [i for p in parts for i in range(p.intermediate_start, p.intermediate_end)]
    assert inter == list(range(arch.intermediate_size))


def test_sizes_that_do_not_divide_are_refused_with_the_sizes() -> None:
    arch = SHAPES["smollm2-135m"]  # 9 heads, 3 kv heads, MLP 1536
    with pytest.raises(ValueError) as refused:
        check_tp_size(arch, 2, "smollm2-135m")
    message = str(refused.value)
    assert "tensor_parallel_size 2" in message and "smollm2-135m" in message
    assert "9 attention heads, 3 kv heads" in message
    assert message.endswith("Sizes that work: 1, 3")
    # kv heads that neither divide nor are divided by the size
    with pytest.raises(ValueError, match="6 kv heads"):
        check_tp_size(parse_synthetic("synthetic:tiny-llama:heads=12,kv_heads=6"), 4)
    with pytest.raises(ValueError, match="must be >= 1"):
        check_tp_size(arch, 0)
