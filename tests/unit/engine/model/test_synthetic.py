"""synthetic:<shape>: real shapes, overrides, seeded non-degenerate weights on device/dtype."""

from __future__ import annotations

import pytest
import torch

from engine.model import load_model
from engine.model.synthetic import SHAPES, parse_synthetic
from kernels.attention.torch_backend import TorchAttentionBackend
from pdserve.config import ModelConfig
from tests.unit.engine.model.conftest import (
    assign_blocks,
    build_step,
    make_kv_caches,
    random_prompts,
)


def load(model: str, seed: int = 0, dtype: torch.dtype = torch.float32):
    config = ModelConfig(model=model, seed=seed)
    return load_model(config, TorchAttentionBackend(), torch.device("cpu"), dtype)


def last_token_logits(loaded, prompts: list[list[int]]) -> torch.Tensor:  # [num_prompts, vocab]
    lens = [len(p) for p in prompts]
    block_ids, num_blocks = assign_blocks(lens, 8)
    dtype = next(loaded.model.parameters()).dtype
    kv_caches = make_kv_caches(loaded.arch, num_blocks, 8, dtype)
    step = build_step([(p, 0) for p in prompts], block_ids, 8)
    with torch.inference_mode():
        hidden = loaded.model(step.input_ids, step.positions, kv_caches, step.meta)
        last_rows = torch.tensor(lens).cumsum(0) - 1
        return loaded.model.compute_logits(hidden[last_rows])


def test_named_shapes_are_the_real_models():
    llama3 = parse_synthetic("synthetic:llama3-8b")
    assert (llama3.hidden_size, llama3.num_layers, llama3.num_heads, llama3.num_kv_heads) == (
        4096,
        32,
        32,
        8,
    )
    assert (llama3.vocab_size, llama3.intermediate_size, llama3.rope.scaling_type) == (
        128256,
        14336,
        "llama3",
    )
    qwen25 = parse_synthetic("synthetic:qwen2.5-7b")
    assert qwen25.attention_bias and (qwen25.hidden_size, qwen25.num_kv_heads) == (3584, 4)
    qwen3 = parse_synthetic("synthetic:qwen3-8b")
    assert qwen3.qk_norm and (qwen3.num_layers, qwen3.intermediate_size) == (36, 12288)
    smollm2 = parse_synthetic("synthetic:smollm2-135m")
    assert smollm2.tie_word_embeddings and (smollm2.hidden_size, smollm2.num_heads) == (576, 9)
    assert {"llama3-8b", "qwen2.5-7b", "qwen3-8b", "smollm2-135m", "tiny-llama"} <= SHAPES.keys()


def test_overrides_change_only_the_named_fields():
    arch = parse_synthetic("synthetic:llama3-8b:layers=2,vocab=1000:max_len=4096")
    base = SHAPES["llama3-8b"]
    assert (arch.num_layers, arch.vocab_size, arch.max_position_embeddings) == (2, 1000, 4096)
    assert (arch.hidden_size, arch.num_kv_heads, arch.rope) == (
        base.hidden_size,
        base.num_kv_heads,
        base.rope,
    )


@pytest.mark.parametrize(
    "model, message",
    [
        ("synthetic:gpt-5", r"unknown synthetic shape 'gpt-5'.*known: llama3-8b"),
        ("synthetic:tiny-llama:depth=3", r"bad synthetic override 'depth=3'.*one of layers, vocab"),
        ("synthetic:tiny-llama:layers=0", r"bad synthetic override 'layers=0'"),
        ("synthetic:tiny-llama:layers=two", r"key=<positive int>"),
        ("synthetic:tiny-llama:kv_heads=3", r"multiple of kv_heads"),
    ],
)
def test_bad_synthetic_strings_raise(model, message):
    with pytest.raises(ValueError, match=message):
        parse_synthetic(model)


def test_weights_are_seeded_and_logits_non_degenerate():
    prompts = random_prompts([5, 9, 14, 3], 512, seed=5)
    first = load("synthetic:tiny-llama", seed=7)
    logits = last_token_logits(first, prompts)
    assert first.tokenizer_dir is None and first.name == "synthetic:tiny-llama"
    assert torch.isfinite(logits).all()
    assert 2.0 < logits.std() < 8.0
    assert len(set(logits.argmax(-1).tolist())) > 1, (
        "different prompts should pick different tokens"
    )

    same = last_token_logits(load("synthetic:tiny-llama", seed=7), prompts)
    other = last_token_logits(load("synthetic:tiny-llama", seed=8), prompts)
    assert torch.equal(logits, same)
    assert not torch.allclose(logits, other)


@pytest.mark.parametrize("shape", ["tiny-qwen2", "tiny-qwen3", "smollm2-135m:layers=1"])
def test_other_shapes_load_in_bfloat16(shape):
    loaded = load(f"synthetic:{shape}", dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in loaded.model.parameters())
    logits = last_token_logits(loaded, random_prompts([6, 11], loaded.arch.vocab_size))
    assert torch.isfinite(logits).all() and logits.std() > 2.0


def test_tied_shapes_do_not_echo_the_last_token():
    loaded = load("synthetic:tiny-qwen2")
    assert loaded.arch.tie_word_embeddings
    prompts = random_prompts([5, 9, 14, 3, 7, 8], loaded.arch.vocab_size, seed=5)
    picks = last_token_logits(loaded, prompts).argmax(-1).tolist()
    assert sum(pick == prompt[-1] for pick, prompt in zip(picks, prompts)) <= 1
