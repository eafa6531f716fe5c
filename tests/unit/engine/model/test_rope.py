"""RoPE frequencies equal transformers' bit for bit; rotation matches rotate_half."""

from __future__ import annotations

import pytest
import torch

from engine.model.arch_config import RopeConfig
from engine.model.rope import RotaryEmbedding, rope_inv_freq
from kernels.fused.reference import rotary as apply_rotary


def hf_inv_freq(rope_parameters: dict, head_dim: int = 128) -> torch.Tensor:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        max_position_embeddings=131072,
        rope_parameters=rope_parameters,
    )
    rope_type = rope_parameters["rope_type"]
    if rope_type == "default":
        return LlamaRotaryEmbedding.compute_default_rope_parameters(config)[0]
    return ROPE_INIT_FUNCTIONS[rope_type](config)[0]


@pytest.mark.parametrize(
    "rope, params",
    [
        (RopeConfig(theta=500000.0), {"rope_type": "default", "rope_theta": 500000.0}),
        (
            RopeConfig(theta=10000.0, scaling_type="linear", factor=4.0),
            {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        ),
        (
            RopeConfig(theta=500000.0, scaling_type="llama3", factor=32.0),
            {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        ),
    ],
)
def test_inv_freq_matches_transformers_exactly(rope, params):
    assert torch.equal(rope_inv_freq(128, rope), hf_inv_freq(params))


def test_apply_rotary_equals_rotate_half_form():
    gen = torch.Generator().manual_seed(0)
    rotary = RotaryEmbedding(16, RopeConfig(theta=10000.0), max_position=64)
    positions = torch.tensor([0, 5, 63, 7])
    x = torch.randn(4, 3, 16, generator=gen)  # [T, heads, head_dim]
    cos, sin = rotary(positions, x.dtype)

    inv_freq = rope_inv_freq(16, RopeConfig(theta=10000.0))
    freqs = positions[:, None].float() * inv_freq  # [T, 8]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [T, 1, 16]
    x1, x2 = x.chunk(2, dim=-1)
    want = x * emb.cos() + torch.cat((-x2, x1), dim=-1) * emb.sin()
    assert torch.equal(apply_rotary(x, cos, sin), want)
    assert torch.equal(apply_rotary(x, *rotary(torch.zeros(4, dtype=torch.long), x.dtype)), x)


def test_unsupported_rope_settings_raise():
    with pytest.raises(
        ValueError, match="'yarn' is not supported; supported: 'default', 'linear', 'llama3'"
    ):
        rope_inv_freq(64, RopeConfig(scaling_type="yarn"))
    with pytest.raises(ValueError, match="partial_rotary_factor 0.5 is not supported"):
        RotaryEmbedding(64, RopeConfig(partial_rotary_factor=0.5), max_position=8)
