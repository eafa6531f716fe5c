"""Build a `LlamaForCausalLM` on the target device and dtype and fill its weights.

```
ModelConfig.model -> ModelSource (sources.py) -> ModelArchConfig
  -> LlamaForCausalLM built directly on device, in dtype
  -> layer ops (kernels/fused): Triton kernels with the triton/flash_attn backends on CUDA,
     else the torch reference (PDSERVE_SKINNY_GEMM_MAX_M > 0: small steps' projections on the
     Triton skinny GEMM, kernels/gemm)
  -> weights: safetensors (streamed, one tensor at a time) | seeded random (synthetic);
     tensor parallelism: the rank's slices only (shard_loading.py)
  -> LoadedModel(model, arch, name, tokenizer_dir, sampling_defaults)
```
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from engine.distributed import ModelPartition, TensorParallel
from engine.model.arch_config import ModelArchConfig
from engine.model.llama import LlamaForCausalLM
from engine.model.shard_loading import iter_safetensors_shard, synthetic_indexer
from engine.model.sources import resolve_model_source
from engine.model.synthetic import init_synthetic_weights
from kernels.attention.backend import AttentionBackend
from kernels.fused import REFERENCE_OPS, get_layer_ops
from kernels.gemm import cpu_packed
from pdserve import envs
from pdserve.config import ModelConfig
from pdserve.progress import track
from pdserve.sampling_defaults import SamplingDefaults

logger = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass(frozen=True)
class LoadedModel:
    model: LlamaForCausalLM
    arch: ModelArchConfig
    name: str  # stable display name (alias, synthetic string, folder or GGUF stem)
    tokenizer_dir: Path | None  # holds tokenizer.json + tokenizer_config.json; None if absent
    # The Triton kernels went with PDL when it loaded (kernels/pdl.py: a process-wide setting,
    # so a model loaded later in the same process sets it for both)
    dependent_launch: bool = False
    # the model's sampling defaults (ModelSource.sampling_defaults; empty: SamplingParams')
    sampling_defaults: SamplingDefaults = field(default_factory=dict)


def resolve_device(device: str) -> torch.device:
    """ "auto" -> CUDA when available, else CPU; an explicit CUDA device must exist."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not device.startswith(("cpu", "cuda")):
        raise ValueError(
            f"device {device!r} is not supported; use 'auto', 'cpu', 'cuda' or 'cuda:N'"
        )
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but CUDA is not available; use 'cpu'")
    return resolved


def resolve_dtype(dtype: str, device: torch.device, model: str | None = None) -> torch.dtype:
    """The torch dtype for ModelConfig.dtype.

    "auto": float32 on CPU; on CUDA the checkpoint's dtype when it is float16 or bfloat16
    (read from `model` when given), otherwise bfloat16.
    """
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ValueError(
                f"dtype {dtype!r} is not supported; use 'auto' or one of {list(DTYPES)}"
            )
        return DTYPES[dtype]
    if device.type != "cuda":
        return torch.float32
    checkpoint_dtype = resolve_model_source(model).arch.torch_dtype if model else None
    return torch.float16 if checkpoint_dtype == "float16" else torch.bfloat16


def load_model(
    model_config: ModelConfig,
    attn_backend: AttentionBackend,
    device: torch.device,
    dtype: torch.dtype,
    tp: TensorParallel | None = None,
) -> LoadedModel:
    """Resolve `model_config.model`, build the model on `device` in `dtype`, load its weights
    (with `tp`: this rank's shard only; engine/model/shard_loading.py)."""
    start_s = time.perf_counter()
    source = resolve_model_source(model_config.model)
    arch = source.arch
    rank_arch = arch if tp is None else _rank_arch(arch, tp.partition)
    with _default_dtype(dtype), torch.device(device):
        model = LlamaForCausalLM(rank_arch, attn_backend)
    if tp is not None:
        model.set_tensor_parallel(tp.layers)
    if source.hf_dir is None:
        shard = None if tp is None else synthetic_indexer(arch, tp.partition)
        init_synthetic_weights(model, arch, model_config.seed, shard)
    else:
        model.load_weights(_checkpoint(source.hf_dir, source.name, tp))
    model.requires_grad_(False).eval()
    model.set_layer_ops(get_layer_ops(attn_backend.name, device, envs.skinny_gemm_max_m()))
    # The torch reference's F.linear in bf16 on a CPU with bf16 instructions: packed weights.
    if (
        model.layer_ops.name == REFERENCE_OPS.name
        and envs.cpu_packed_gemm()
        and cpu_packed.supported(device, dtype)
    ):
        model.pack_projections()
    pdl = _set_dependent_launch(model.layer_ops.name, device)
    logger.info(
        "loaded %s (%s, %d layers) on %s in %s in %.2f s, layer ops: %s%s",
        source.name,
        arch.architecture,
        arch.num_layers,
        device,
        dtype,
        time.perf_counter() - start_s,
        model.layer_ops.name,
        ", programmatic dependent launch" if pdl else "",
    )
    return LoadedModel(
        model, arch, source.name, source.tokenizer_dir, pdl, source.sampling_defaults
    )


def _rank_arch(arch: ModelArchConfig, part: ModelPartition) -> ModelArchConfig:
    """`arch` with one tensor-parallel rank's sizes: every layer built from it has the shapes
    of the rank's shard."""
    return dataclasses.replace(
        arch, num_heads=part.num_heads, num_kv_heads=part.num_kv_heads,
        intermediate_size=part.intermediate_size, vocab_size=part.vocab_per_rank,
    )  # fmt: skip


def _checkpoint(
    model_dir: Path, name: str, tp: TensorParallel | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """The folder's tensors (this rank's slices of them, with `tp`), with a progress line."""
    if tp is None:
        tensors = iter_safetensors(model_dir)
    else:
        tensors = iter_safetensors_shard(model_dir, _safetensors_files(model_dir), tp.partition)
    return track(tensors, f"loading {name} weights", count_safetensors(model_dir), "tensors",
                 logger)  # fmt: skip


def _set_dependent_launch(layer_ops: str, device: torch.device) -> bool:
    """Launch the Triton kernels of a step with PDL (kernels/pdl.py) where PDSERVE_PDL asks
    for it and the GPU and Triton have it; returns whether they are."""
    if not layer_ops.startswith("triton"):  # the torch reference: no Triton kernels to launch
        return False
    from kernels import pdl  # imports triton, which the Triton layer ops have

    on = envs.dependent_launch() and pdl.supported(torch.cuda.get_device_capability(device))
    pdl.set_enabled(on)
    return on


def _safetensors_files(model_dir: Path) -> list[str]:
    index_path = model_dir / "model.safetensors.index.json"
    if index_path.exists():
        return sorted(set(json.loads(index_path.read_text())["weight_map"].values()))
    return sorted(path.name for path in model_dir.glob("*.safetensors"))


def count_safetensors(model_dir: Path) -> int:
    """How many tensors `iter_safetensors` yields (reads only the files' headers)."""
    total = 0
    for file_name in _safetensors_files(model_dir):
        with safe_open(model_dir / file_name, framework="pt", device="cpu") as tensors:
            total += len(tensors.keys())
    return total


def iter_safetensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, CPU tensor) of every tensor in the folder's safetensors files (sharded too)."""
    for file_name in _safetensors_files(model_dir):
        with safe_open(model_dir / file_name, framework="pt", device="cpu") as tensors:
            for name in tensors.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, tensors.get_tensor(name)


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
