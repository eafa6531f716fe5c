"""KVLayout: validation, byte sizes, and a layout hash that is stable and field-sensitive."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cache_transfer import KVLayout

LLAMA3_8B = dict(model="llama3-8b", num_layers=32, num_kv_heads=8, head_dim=128, block_size=16)


def test_bytes_per_block_counts_k_and_v_in_the_dtype() -> None:
    bf16 = KVLayout(dtype="bfloat16", **LLAMA3_8B)
    fp32 = KVLayout(dtype="float32", **LLAMA3_8B)

    assert bf16.bytes_per_block == 2 * 16 * 8 * 128 * 2
    assert fp32.bytes_per_block == 2 * bf16.bytes_per_block
    assert bf16.layer_bytes(3) == 3 * bf16.bytes_per_block
    assert bf16.block_shape == (16, 8, 128)
    assert bf16.torch_dtype == torch.bfloat16


@pytest.mark.parametrize(("num_tokens", "num_blocks"), [(1, 1), (16, 1), (17, 2), (32, 2), (33, 3)])
def test_num_blocks_for_rounds_up(num_tokens: int, num_blocks: int) -> None:
    assert KVLayout(dtype="bfloat16", **LLAMA3_8B).num_blocks_for(num_tokens) == num_blocks


def test_layout_hash_is_pinned() -> None:
    # Peers built from different versions must agree: change this only with PROTOCOL_VERSION.
    layout = KVLayout(dtype="bfloat16", **LLAMA3_8B)

    assert layout.layout_hash() == (
        "9a265778b570edc0d478c85853b6780a48ee7b5d74869f13636d5ae7732c8100"
    )


def test_from_dtype_matches_the_named_dtype() -> None:
    by_name = KVLayout(dtype="float16", **LLAMA3_8B)
    by_torch = KVLayout.from_dtype(torch.float16, **LLAMA3_8B)

    assert by_torch == by_name
    assert by_torch.layout_hash() == by_name.layout_hash()


@pytest.mark.parametrize(
    "change",
    [
        {"model": "llama3-8b-instruct"},
        {"num_layers": 31},
        {"num_kv_heads": 4},
        {"head_dim": 64},
        {"block_size": 32},
        {"dtype": "float16"},
    ],
)
def test_every_field_changes_the_hash(change: dict[str, object]) -> None:
    layout = KVLayout(dtype="bfloat16", **LLAMA3_8B)

    assert dataclasses.replace(layout, **change).layout_hash() != layout.layout_hash()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"dtype": "int8"}, "dtype must be one of"),
        ({"dtype": "bfloat16", "num_layers": 0}, "num_layers must be a positive int"),
        ({"dtype": "bfloat16", "block_size": -16}, "block_size must be a positive int"),
    ],
)
def test_invalid_fields_are_refused(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KVLayout(**{**LLAMA3_8B, **fields})  # type: ignore[arg-type]


def test_from_dtype_refuses_an_unsupported_dtype() -> None:
    with pytest.raises(ValueError, match="unsupported KV cache dtype"):
        KVLayout.from_dtype(torch.int8, **LLAMA3_8B)
