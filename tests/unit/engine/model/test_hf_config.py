"""config.json -> ModelArchConfig: every supported architecture, both RoPE forms, clear errors."""

from __future__ import annotations

import json

import pytest

from engine.model.arch_config import ModelArchConfig, RopeConfig
from engine.model.hf_config import arch_config_from_hf, read_arch_config


def llama_config(**overrides) -> dict:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "torch_dtype": "bfloat16",
    }
    config.update(overrides)
    return config


LLAMA3_SCALING = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
LLAMA3_ROPE = RopeConfig(theta=500000.0, scaling_type="llama3", factor=8.0)


def test_llama3_legacy_rope_scaling_form():
    arch = arch_config_from_hf(
        llama_config(rope_theta=500000.0, rope_scaling={"rope_type": "llama3", **LLAMA3_SCALING})
    )
    assert arch == ModelArchConfig(
        architecture="LlamaForCausalLM",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope=LLAMA3_ROPE,
        torch_dtype="bfloat16",
        eos_token_ids=(128001,),
        bos_token_id=128000,
    )


def test_rope_parameters_form_equals_legacy_form():
    new = arch_config_from_hf(
        llama_config(
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3_SCALING},
            dtype="bfloat16",
            torch_dtype=None,
        )
    )
    legacy = arch_config_from_hf(
        llama_config(rope_theta=500000.0, rope_scaling={"type": "llama3", **LLAMA3_SCALING})
    )
    assert new.rope == legacy.rope == LLAMA3_ROPE
    assert new.torch_dtype == "bfloat16"


@pytest.mark.parametrize(
    "config, want",
    [
        (llama_config(), RopeConfig()),
        (llama_config(rope_theta=1e6, rope_scaling=None), RopeConfig(theta=1e6)),
        (
            llama_config(rope_parameters={"rope_type": "default", "rope_theta": 1e5}),
            RopeConfig(theta=1e5),
        ),
        (
            llama_config(rope_scaling={"type": "linear", "factor": 4.0}),
            RopeConfig(scaling_type="linear", factor=4.0),
        ),
    ],
)
def test_default_and_linear_rope(config, want):
    assert arch_config_from_hf(config).rope == want


def test_llama3_without_original_context_falls_back_to_max_positions():
    scaling = {k: v for k, v in LLAMA3_SCALING.items() if k != "original_max_position_embeddings"}
    arch = arch_config_from_hf(llama_config(rope_scaling={"rope_type": "llama3", **scaling}))
    assert arch.rope.original_max_position_embeddings == 131072


def test_qwen2_implies_qkv_bias_and_qwen3_qk_norm():
    qwen2 = arch_config_from_hf(llama_config(architectures=["Qwen2ForCausalLM"]))
    assert qwen2.attention_bias and not qwen2.qk_norm
    qwen3 = arch_config_from_hf(llama_config(architectures=["Qwen3ForCausalLM"], head_dim=96))
    assert qwen3.qk_norm and not qwen3.attention_bias
    assert qwen3.head_dim == 96  # explicit head_dim wins over hidden / heads
    llama = arch_config_from_hf(llama_config(attention_bias=True))
    assert llama.attention_bias


def test_defaults_for_optional_keys():
    config = llama_config()
    for key in (
        "num_key_value_heads",
        "rms_norm_eps",
        "hidden_act",
        "eos_token_id",
        "bos_token_id",
    ):
        del config[key]
    arch = arch_config_from_hf(config)
    assert arch.num_kv_heads == 32
    assert arch.head_dim == 128
    assert arch.rms_norm_eps == 1e-6
    assert arch.eos_token_ids == ()
    assert arch.bos_token_id is None
    assert not arch.tie_word_embeddings


def test_tied_embeddings_and_eos_lists():
    arch = arch_config_from_hf(
        llama_config(tie_word_embeddings=True, eos_token_id=[128001, 128009]),
        {"eos_token_id": [128009, 128008], "bos_token_id": 128000},
    )
    assert arch.tie_word_embeddings
    assert arch.eos_token_ids == (128001, 128009, 128008)


def test_sliding_window_caps_the_context():
    mistral = arch_config_from_hf(
        llama_config(
            architectures=["MistralForCausalLM"], max_position_embeddings=32768, sliding_window=4096
        )
    )
    assert mistral.max_position_embeddings == 4096
    mistral_v3 = arch_config_from_hf(
        llama_config(
            architectures=["MistralForCausalLM"], max_position_embeddings=32768, sliding_window=None
        )
    )
    assert mistral_v3.max_position_embeddings == 32768
    qwen_off = arch_config_from_hf(
        llama_config(
            architectures=["Qwen2ForCausalLM"],
            max_position_embeddings=32768,
            sliding_window=4096,
            use_sliding_window=False,
        )
    )
    assert qwen_off.max_position_embeddings == 32768


def test_read_arch_config_merges_generation_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(llama_config()))
    assert read_arch_config(tmp_path).eos_token_ids == (128001,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [128001, 128009]}))
    assert read_arch_config(tmp_path).eos_token_ids == (128001, 128009)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            {"architectures": ["GPT2LMHeadModel"]},
            r"'GPT2LMHeadModel' is not supported; supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM",
        ),
        ({"architectures": []}, r"no 'architectures'; supported: LlamaForCausalLM"),
        (
            {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
            r"'yarn' is not supported; supported: default, linear, llama3",
        ),
        (
            {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4}},
            r"'dynamic' is not supported; supported: default",
        ),
        ({"hidden_act": "gelu"}, r"hidden_act 'gelu' is not supported; supported: 'silu'"),
        (
            {"partial_rotary_factor": 0.5},
            r"partial_rotary_factor 0.5 is not supported; supported: 1.0",
        ),
        ({"num_key_value_heads": 5}, r"multiple of num_key_value_heads \(5\)"),
        ({"hidden_size": None}, r"lacks 'hidden_size'"),
        ({"num_hidden_layers": 0}, r"'num_hidden_layers' must be a positive integer, got 0"),
        ({"intermediate_size": "11008"}, r"'intermediate_size' must be a positive integer"),
        ({"vocab_size": 32000.0}, r"'vocab_size' must be a positive integer, got 32000.0"),
        ({"quantization_config": {"quant_method": "awq"}}, r"quantized checkpoints"),
        ({"mlp_bias": True}, r"mlp_bias"),
    ],
)
def test_unsupported_configs_raise_with_what_is_supported(overrides, message):
    with pytest.raises(ValueError, match=message):
        arch_config_from_hf(llama_config(**overrides))
