"""The architecture of a Llama-family model, read from a Hugging Face config.json.

One frozen dataclass covers Llama 2/3, Mistral, Qwen2/2.5 (QKV bias), Qwen3 (q/k RMSNorm) and
SmolLM2; `from_hf_config` maps a config dict (both `rope_scaling` and the newer
`rope_parameters` forms) onto it and refuses architectures it does not implement.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    # "default" | "linear" | "llama3" (others are refused with a clear error)
    scaling_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192  # llama3
    partial_rotary_factor: float = 1.0


@dataclass(frozen=True)
class ModelArchConfig:
    architecture: str  # HF architectures[0], e.g. "LlamaForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    attention_bias: bool = False  # Qwen2/2.5: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    torch_dtype: str = "float32"  # the checkpoint's dtype ("auto" resolves to it on GPU)
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    def layout_fields(self) -> dict:
        """The fields a KV layout depends on (used in the transfer layout hash)."""
        return {
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
        }
