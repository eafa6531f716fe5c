"""The engine's settings: `EngineConfig` = `ModelConfig` + `CacheConfig` + `SchedulerConfig`
+ `SpeculativeConfig` + `ParallelConfig` (both node roles and the offline `LLM`). Each field is a `knob` (pdserve.knobs): its flag is
generated from it. Torch-free; `pdserve.config` lists these beside every other setting."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from pdserve.knobs import knob, parse_size, prefix_cache_salt_knob

DEFAULT_MODEL = "smollm2-135m"
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flash_attn")
ASYNC_SCHEDULING = ("auto", "on", "off")
DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")
SPECULATIVE_METHODS = ("ngram", "draft")  # engine/spec_decode's proposers


@dataclass(frozen=True)
class ModelConfig:
    """Which weights, in which dtype, on which device."""

    model: str = knob(DEFAULT_MODEL, "alias, Hugging Face folder, .gguf file, or synthetic:<shape>")
    dtype: str = knob("auto", "weights and KV cache dtype (auto: the checkpoint's)", choices=DTYPES)
    device: str = knob("auto", "auto | cpu | cuda | cuda:N")
    max_model_len: int | None = knob(None, "context length (default: the model's)")
    seed: int = knob(0, "synthetic weights and unseeded sampling")
    attention_backend: str = knob(
        "auto", "attention kernels (auto: triton on CUDA, torch on CPU)", choices=ATTENTION_BACKENDS
    )
    enforce_eager: bool = knob(
        False, "on CUDA, run decode steps eagerly instead of replaying captured CUDA graphs"
    )


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: block geometry and how much memory the pool takes.

    Pool size: exactly `num_blocks` if set; else `kv_cache_memory` bytes if set; else on CUDA
    `gpu_memory_utilization` of the free memory after the weights, on CPU 1 GiB.
    `kv_offload_memory`: bytes of host memory for the host tier (engine/kv_offload), 0: none."""

    block_size: int = knob(
        16, "tokens per KV block (flash_attn needs a multiple of 256; with it, 16 becomes 256)"
    )
    num_blocks: int | None = knob(
        None,
        "exact KV pool size in blocks (default: from --kv-cache-memory)",
        flag="--num-kv-blocks",
    )
    kv_cache_memory: int | None = knob(
        None,
        "KV cache size, e.g. 2GiB (default: 1 GiB on CPU, a fraction of free GPU memory)",
        parse=parse_size,
    )
    gpu_memory_utilization: float = knob(
        0.85,
        "on CUDA without --kv-cache-memory: the fraction of free GPU memory the KV cache takes",
    )
    enable_prefix_caching: bool = knob(
        True,
        "turn the prefix cache off: every prompt is prefilled whole (default: on: prompts "
        "that share a prefix reuse its KV blocks)",
        flag="--no-prefix-caching",
    )
    prefix_cache_salt: str | None = prefix_cache_salt_knob()
    kv_cache_dtype: str = knob(
        "auto",
        "KV cache storage (auto: the model's dtype; fp8_e4m3: 1 byte per value, scales per "
        "layer and KV head; twice the blocks of bf16 in the same memory)",
        choices=KV_CACHE_DTYPES,
    )
    kv_offload_memory: int = knob(
        0,
        "host memory for a tier under the prefix cache, e.g. 16GiB (page-locked on CUDA): "
        "evicted blocks are kept there and copied back on a hit (0: off)",
        parse=parse_size,
    )


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits."""

    max_num_batched_tokens: int = knob(2048, "token budget of one step (prefill chunks + decodes)")
    max_num_seqs: int = knob(128, "requests running at once")
    enable_chunked_prefill: bool = knob(
        True,
        "prefill each prompt in one step, however long (default: on: a prompt longer than "
        "--max-num-batched-tokens is split over several steps)",
        flag="--no-chunked-prefill",
    )
    async_scheduling: str = knob("auto", "launch the next decode step before this one's tokens "
                                 "are on the host (auto: on CUDA, not in the prefill role)",
                                 choices=ASYNC_SCHEDULING)  # fmt: skip
    # Prefill-only (the prefill role): a request finishes after its first token and keeps its
    # blocks until `EngineCore.release` (the KV transfer resolved).
    prefill_only: bool = knob(False, "set by the prefill role", cli=False)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (engine/spec_decode): a proposer drafts up to K tokens for each
    decoding request and the model verifies them in one forward. Off unless a method is set."""

    speculative_method: str | None = knob(
        None, "ngram: prompt lookup; draft: a smaller model (--speculative-model) proposes "
        "(default: off)", choices=SPECULATIVE_METHODS,
    )  # fmt: skip
    num_speculative_tokens: int = knob(4, "draft tokens verified per decoding request and step")
    speculative_model: str | None = knob(
        None, "--speculative-method draft: alias, HF folder, .gguf or synthetic:<shape>, with the "
        "target's vocabulary",
    )  # fmt: skip
    ngram_prompt_lookup_min: int = knob(
        2, "ngram: the shortest suffix n-gram looked up (a 1-token match drafts poorly)"
    )
    ngram_prompt_lookup_max: int = knob(4, "ngram: the longest suffix n-gram looked up")

    def __post_init__(self) -> None:
        method, k = self.speculative_method, self.num_speculative_tokens
        if method is not None and method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_method must be one of {SPECULATIVE_METHODS}, not {method!r}"
            )
        if not 1 <= k <= 16:
            raise ValueError(f"num_speculative_tokens must be in [1, 16], got {k}")
        if (method == "draft") != (self.speculative_model is not None):
            raise ValueError(
                "--speculative-model goes with --speculative-method draft, and only with it; got "
                f"method {method!r}, model {self.speculative_model!r}"
            )
        if not 1 <= self.ngram_prompt_lookup_min <= self.ngram_prompt_lookup_max:
            raise ValueError(
                "need 1 <= ngram_prompt_lookup_min <= ngram_prompt_lookup_max, got "
                f"{self.ngram_prompt_lookup_min} and {self.ngram_prompt_lookup_max}"
            )


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism: the model split over N ranks, one process each (engine/distributed)."""

    tensor_parallel_size: int = knob(
        1, "ranks the model is split over (tensor parallelism); its attention heads and MLP "
        "must divide by it",
    )  # fmt: skip
    devices: str | None = knob(
        None, "the ranks' devices, comma-separated, e.g. cuda:0,cuda:1 (default: the first N "
        "of --device's kind)",
    )  # fmt: skip
    tp_start_timeout_s: float = knob(
        600.0, "how long the ranks may take to start (load their shard, capture graphs)"
    )
    tp_step_timeout_s: float = knob(
        60.0, "how long a rank may wait in a collective: a rank that hangs is detected after it"
    )

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if not (self.tp_start_timeout_s > 0 and self.tp_step_timeout_s > 0):
            raise ValueError("tp_start_timeout_s and tp_step_timeout_s must be > 0 seconds")
        names = [] if self.devices is None else self.devices.split(",")
        if names and len(names) != self.tensor_parallel_size:
            raise ValueError(
                f"--devices {self.devices} names {len(names)} devices for "
                f"--tensor-parallel-size {self.tensor_parallel_size}: name one per rank"
            )
        if any(not name.strip().startswith(("cpu", "cuda")) for name in names):
            raise ValueError(f"--devices {self.devices}: each is cpu, cuda or cuda:N")


ENGINE_SECTIONS: dict[str, type[Any]] = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "speculative": SpeculativeConfig,
    "parallel": ParallelConfig,
}


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        method, tp = self.speculative.speculative_method, self.parallel.tensor_parallel_size
        if method is not None and tp > 1:
            raise ValueError(
                f"--speculative-method {method} is not supported with --tensor-parallel-size {tp} "
                "(the verify step does not run across ranks yet): drop one of the two"
            )
        refusal = kv_cache_dtype_tp_refusal(self.cache.kv_cache_dtype, tp)
        if refusal is not None:
            raise ValueError(refusal)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Any field of any section by its own name, e.g. `from_kwargs(model="...",
        block_size=32, max_num_seqs=8)`. TypeError names an unknown keyword."""
        sections: dict[str, dict[str, Any]] = {name: {} for name in ENGINE_SECTIONS}
        owner = {
            f.name: section
            for section, section_cls in ENGINE_SECTIONS.items()
            for f in dataclasses.fields(section_cls)
        }
        for name, value in kwargs.items():
            if name not in owner:
                raise TypeError(
                    f"unknown engine setting {name!r}; known: {', '.join(sorted(owner))}"
                )
            sections[owner[name]][name] = value
        return cls(**{s: ENGINE_SECTIONS[s](**values) for s, values in sections.items()})


def kv_cache_dtype_tp_refusal(kv_cache_dtype: str, tensor_parallel_size: int) -> str | None:
    """Why a KV cache dtype cannot run at a tensor-parallel size, or None: an FP8 cache is
    not wired for tensor parallelism (each rank's scales, the TP kernels and hand-offs over
    FP8 blocks are untested), so it is refused at start rather than served unchecked."""
    if kv_cache_dtype == "auto" or tensor_parallel_size <= 1:
        return None
    return (
        f"--kv-cache-dtype {kv_cache_dtype} with --tensor-parallel-size {tensor_parallel_size}: "
        "an FP8 KV cache is not supported with tensor parallelism yet; use --kv-cache-dtype "
        "auto or --tensor-parallel-size 1"
    )
