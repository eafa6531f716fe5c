"""Every environment variable pdserve reads, in one place.

Functions, not constants, so tests can set a variable and see it take effect.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where converted models (GGUF -> safetensors) are cached. PDSERVE_CACHE_DIR, else
    $XDG_CACHE_HOME/pdserve, else ~/.cache/pdserve."""
    explicit = os.environ.get("PDSERVE_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pdserve"


def cuda_visible_devices() -> list[str] | None:
    """The GPU ids CUDA_VISIBLE_DEVICES lists (None when unset: every GPU is visible)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return None
    return [device.strip() for device in visible.split(",") if device.strip()]


def cluster_secret_file() -> str | None:
    """PDSERVE_CLUSTER_SECRET_FILE: the cluster secret's file when --cluster-secret-file is not
    given (pdserve.security)."""
    return os.environ.get("PDSERVE_CLUSTER_SECRET_FILE") or None


def prefix_cache_salt() -> str | None:
    """PDSERVE_PREFIX_CACHE_SALT: the prefix cache's salt when --prefix-cache-salt is not given
    (pdserve.block_hash)."""
    return os.environ.get("PDSERVE_PREFIX_CACHE_SALT") or None


def api_key() -> str | None:
    """PDSERVE_API_KEY: the key pd-client sends (`authorization: Bearer KEY`) to a router
    started with --api-key-file."""
    return os.environ.get("PDSERVE_API_KEY") or None


def skinny_gemm_max_m() -> int:
    """PDSERVE_SKINNY_GEMM_MAX_M: the model's projections (QKV, o_proj, gate_up, down, LM head)
    of a step with at most this many tokens may run on the Triton skinny GEMM (kernels/gemm)
    instead of cuBLAS, with the Triton layer ops on CUDA in float16/bfloat16, where it measured
    faster for that very shape (kernels.gemm.MEASURED_WINS). Unset: kernels.gemm.MAX_M (128);
    0: off (cuBLAS everywhere); at most MAX_M (checked where the layer ops are picked)."""
    raw = os.environ.get("PDSERVE_SKINNY_GEMM_MAX_M", "").strip()
    if not raw:
        return 128  # kernels.gemm.MAX_M (not imported here: pdserve does not import kernels)
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"PDSERVE_SKINNY_GEMM_MAX_M must be an integer, got {raw!r}") from None
    if value < 0:
        raise ValueError(f"PDSERVE_SKINNY_GEMM_MAX_M must be >= 0 (0: off), got {value}")
    return value


def dependent_launch() -> bool:
    """PDSERVE_PDL: launch the Triton kernels of a step with programmatic dependent launch
    (kernels/pdl.py: each kernel scheduled while the one before finishes, the skinny GEMM
    prefetching its weights meanwhile) on GPUs that have it (sm_90+): "1" or unset on, "0" off."""
    return _on_off("PDSERVE_PDL")


def cpu_packed_gemm() -> bool:
    """PDSERVE_CPU_PACKED_GEMM: on a CPU with bf16 instructions, a bf16 model's projections
    run oneDNN on weights packed once at load (kernels/gemm/cpu_packed.py): "1" or unset on,
    "0" off (F.linear, which repacks the weight on every call)."""
    return _on_off("PDSERVE_CPU_PACKED_GEMM")


def cpu_attention_kernel() -> bool:
    """PDSERVE_CPU_ATTENTION_KERNEL: a bf16/fp16 model on CPU attends its decode rows with the
    C++ kernel (kernels/attention/cpu_paged_decode.py, built on first use; without a compiler
    it stays off): "1" or unset on, "0" off (gather + SDPA)."""
    return _on_off("PDSERVE_CPU_ATTENTION_KERNEL")


def _on_off(name: str) -> bool:
    """A switch that is on by default: "1" or unset on, "0" off, anything else an error."""
    raw = os.environ.get(name, "").strip()
    if raw not in ("", "0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {raw!r}")
    return raw != "0"
