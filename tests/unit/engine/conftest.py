"""Tiny random Hugging Face checkpoints of every supported architecture, built from a config."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

# Small enough for fast CPU tests, large enough for peaked logits (few near-ties in greedy).
_COMMON = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    initializer_range=0.08,
    bos_token_id=1,
    eos_token_id=2,
)

ARCHS: dict[str, dict] = {
    "llama": dict(model_type="llama", tie_word_embeddings=False),
    "llama3-rope": dict(
        model_type="llama",
        tie_word_embeddings=True,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "mistral": dict(model_type="mistral", tie_word_embeddings=False, sliding_window=None),
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", tie_word_embeddings=False, head_dim=32),
}


def build_tiny_checkpoint(arch: str, path: Path, seed: int = 0) -> Path:
    """Save a seeded random HF model of `arch` (a key of ARCHS) to `path`; return `path`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    overrides = dict(ARCHS[arch])
    model_type = overrides.pop("model_type")
    config = AutoConfig.for_model(model_type, **_COMMON, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-models")
    return {arch: build_tiny_checkpoint(arch, root / arch) for arch in ARCHS}


def random_prompts(
    num_prompts: int, vocab_size: int, seed: int = 0, min_len: int = 3, max_len: int = 40
):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (num_prompts,), generator=gen).tolist()
    # Avoid special ids 0..2 so no prompt contains EOS.
    return [torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in lengths]
