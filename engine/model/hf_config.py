"""Map a Hugging Face config.json (+ generation_config.json) onto `ModelArchConfig`.

Accepts Llama, Mistral, Qwen2 and Qwen3 (SmolLM2 is Llama) in both RoPE forms:

```
transformers < 5:  "rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", "factor": 8, ...}
transformers >= 5: "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8, ...}
```

Anything this engine cannot run exactly raises ValueError saying what is supported.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from engine.model.arch_config import ModelArchConfig, RopeConfig

logger = logging.getLogger(__name__)

# architectures[0] -> what the architecture implies beyond its config keys
SUPPORTED_ARCHITECTURES: dict[str, dict[str, bool]] = {
    "LlamaForCausalLM": {},
    "MistralForCausalLM": {},
    "Qwen2ForCausalLM": {"attention_bias": True},  # QKV bias, never stated in config.json
    "Qwen3ForCausalLM": {"qk_norm": True},
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def read_arch_config(model_dir: Path) -> ModelArchConfig:
    """The architecture of the HF folder `model_dir` (config.json, optional generation_config)."""
    config = json.loads((model_dir / "config.json").read_text())
    generation_path = model_dir / "generation_config.json"
    generation = json.loads(generation_path.read_text()) if generation_path.exists() else None
    return arch_config_from_hf(config, generation)


def arch_config_from_hf(
    config: dict[str, Any], generation_config: dict[str, Any] | None = None
) -> ModelArchConfig:
    """A `ModelArchConfig` from config.json's dict; EOS ids also from generation_config."""
    architecture = _architecture(config)
    _check_supported_features(config)
    implied = SUPPORTED_ARCHITECTURES[architecture]
    hidden_size = _require_size(config, "hidden_size")
    num_heads = _require_size(config, "num_attention_heads")
    num_kv_heads = config.get("num_key_value_heads") or num_heads
    if num_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_attention_heads ({num_heads}) must be a multiple of "
            f"num_key_value_heads ({num_kv_heads})"
        )
    generation_config = generation_config or {}
    bos_token_id = config.get("bos_token_id", generation_config.get("bos_token_id"))
    return ModelArchConfig(
        architecture=architecture,
        vocab_size=_require_size(config, "vocab_size"),
        hidden_size=hidden_size,
        intermediate_size=_require_size(config, "intermediate_size"),
        num_layers=_require_size(config, "num_hidden_layers"),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=config.get("head_dim") or hidden_size // num_heads,
        max_position_embeddings=_max_position_embeddings(config, architecture),
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        rope=_rope_config(config),
        attention_bias=implied.get("attention_bias", bool(config.get("attention_bias", False))),
        qk_norm=implied.get("qk_norm", False),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        hidden_act=config.get("hidden_act", "silu"),
        torch_dtype=config.get("dtype") or config.get("torch_dtype") or "float32",
        eos_token_ids=_eos_token_ids(config, generation_config),
        bos_token_id=bos_token_id if isinstance(bos_token_id, int) else None,
    )


def _architecture(config: dict[str, Any]) -> str:
    architectures = config.get("architectures") or []
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    if not architectures:
        raise ValueError(f"config.json names no 'architectures'; supported: {supported}")
    if architectures[0] not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"architecture {architectures[0]!r} is not supported; supported: {supported}"
        )
    return architectures[0]


def _check_supported_features(config: dict[str, Any]) -> None:
    hidden_act = config.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise ValueError(f"hidden_act {hidden_act!r} is not supported; supported: 'silu'")
    if config.get("mlp_bias"):
        raise ValueError("mlp_bias=true is not supported; supported: MLPs without bias")
    if config.get("quantization_config"):
        raise ValueError(
            "quantized checkpoints (quantization_config) are not supported; "
            "use a float32/bfloat16/float16 checkpoint or a .gguf file"
        )


def _require_size(config: dict[str, Any], key: str) -> int:
    """A size the model's shapes are made of: present and a positive integer."""
    value = _require(config, key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"config.json's {key!r} must be a positive integer, got {value!r}")
    return value


def _require(config: dict[str, Any], key: str) -> Any:
    if config.get(key) is None:
        raise ValueError(f"config.json lacks {key!r}, which a Llama-family model needs")
    return config[key]


def _max_position_embeddings(config: dict[str, Any], architecture: str) -> int:
    """The context length, capped at the sliding window when the model uses one.

    Attention here is always full; below the window that equals sliding-window attention
    exactly, so capping the context keeps results exact (e.g. Mistral-7B-v0.1's 4096).
    """
    max_position = _require(config, "max_position_embeddings")
    window = config.get("sliding_window")
    uses_window = (
        architecture == "MistralForCausalLM"
        or config.get("use_sliding_window", False)
        or "sliding_attention" in (config.get("layer_types") or ())
    )
    if uses_window and window and window < max_position:
        logger.info("capping the context at the sliding window: %d tokens", window)
        return window
    return max_position


def _rope_config(config: dict[str, Any]) -> RopeConfig:
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if any(isinstance(value, dict) for value in params.values()):
        raise ValueError("per-layer-type rope_parameters are not supported; supported: one dict")
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor {partial} is not supported; supported: 1.0")
    if rope_type == "default":
        return RopeConfig(theta=theta)
    factor = _require(params, "factor")
    if rope_type == "linear":
        return RopeConfig(theta=theta, scaling_type="linear", factor=factor)
    return RopeConfig(
        theta=theta,
        scaling_type="llama3",
        factor=factor,
        low_freq_factor=_require(params, "low_freq_factor"),
        high_freq_factor=_require(params, "high_freq_factor"),
        original_max_position_embeddings=params.get(
            "original_max_position_embeddings", config["max_position_embeddings"]
        ),
    )


def _eos_token_ids(config: dict[str, Any], generation_config: dict[str, Any]) -> tuple[int, ...]:
    """config.json's EOS ids, then generation_config.json's (instruct models add turn ends)."""
    ids: list[int] = []
    for value in (config.get("eos_token_id"), generation_config.get("eos_token_id")):
        for token_id in [value] if isinstance(value, int) else value or []:
            if token_id not in ids:
                ids.append(token_id)
    return tuple(ids)
