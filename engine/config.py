"""Engine configuration: one frozen dataclass per concern, composed into `EngineConfig`.

The role launchers build these from CLI flags (one shared builder); the offline `LLM` builds
them from keyword arguments. Nothing here reads the environment (see `pdserve.envs`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class ModelConfig:
    """Which weights, in which dtype, on which device."""

    model: str = DEFAULT_MODEL  # alias, HF folder, .gguf file, or "synthetic:<shape>"
    dtype: str = "auto"  # "auto" | "float32" | "bfloat16" | "float16"
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N"
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    seed: int = 0  # synthetic weights and unseeded sampling
    attention_backend: str = "auto"  # "auto" | "torch" | "triton" | "flash_attn"


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: block geometry and how much memory the pool takes."""

    block_size: int = 16
    # Pool size: exactly `num_blocks` if set; else `kv_cache_memory` bytes if set; else on
    # CUDA `gpu_memory_utilization` of the free memory after the weights, on CPU 1 GiB.
    num_blocks: int | None = None
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.85
    enable_prefix_caching: bool = True


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits."""

    max_num_batched_tokens: int = 2048  # token budget of one step (prefill chunks + decodes)
    max_num_seqs: int = 128  # requests running at once
    enable_chunked_prefill: bool = True
    # Prefill-only (the prefill role): a request finishes after its first token and keeps its
    # blocks until `EngineCore.release` (the KV transfer resolved).
    prefill_only: bool = False


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
