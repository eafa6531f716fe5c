"""Paged decode attention on CPU in C++ (cpu_paged_decode.cpp), built on first use.

The torch path gathers each decode row's context blocks into a padded tensor (a copy of every
key and value, every layer, every step) and runs SDPA on it. This kernel reads the blocks in
place through the block table: one task per (request, KV head), its query heads sharing each
loaded key and value row, fp32 scores and softmax. On smollm2-135m's shapes in bf16, 20 decode
rows of 150-380 tokens, a layer's decode attention takes about half the time of gather + SDPA
(benchmarks/results/2026-12-05-cpu-bf16-kernels.txt).

```
available()                     built and loaded (builds on the first call; False if no compiler)
paged_decode_attention(q [B, H, D], k_cache, v_cache [NB, BS, KVH, D],
                       block_tables [B, MB] int32, seq_lens [B] int32, scale) -> [B, H, D]
```

The build (torch.utils.cpp_extension, ~10 s with g++ on this 2-core machine) is cached under
TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions) in a folder named by a hash of the
source, the flags and this CPU's feature flags, so another CPU never loads code built with
instructions it lacks. Builds from several processes at once take torch's lock on the folder.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import threading
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cpu_paged_decode.cpp")
_FLAGS = ["-O3", "-march=native", "-fopenmp"]  # OpenMP: at::parallel_for's threads
_lock = threading.Lock()
_state: dict[str, bool] = {}  # "loaded": the build's outcome, once known


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def _build_name() -> str:
    digest = hashlib.sha1()
    for part in (_SOURCE.read_bytes(), " ".join(_FLAGS).encode(), _cpu_flags().encode(),
                 torch.__version__.encode()):  # fmt: skip
        digest.update(part)
    return f"pdserve_cpu_paged_decode_{digest.hexdigest()[:12]}"


def available() -> bool:
    """Whether the kernel is loaded: builds it on the first call (a C++ compiler and ninja are
    needed); a failed build is logged once and the caller keeps its torch path."""
    with _lock:
        if "loaded" not in _state:
            _state["loaded"] = _load()
        return _state["loaded"]


def _load() -> bool:
    if shutil.which("c++") is None and shutil.which("g++") is None:
        logger.warning("no C++ compiler: CPU decode attention stays on gather + SDPA")
        return False
    from torch.utils import cpp_extension

    name, start = _build_name(), time.perf_counter()
    try:
        cpp_extension.load(
            name=name,
            sources=[str(_SOURCE)],
            extra_cflags=_FLAGS,
            is_python_module=False,
            verbose=False,
        )
    except Exception as exc:  # a build error, a missing ninja: log it, keep the torch path
        logger.warning("could not build the CPU decode attention kernel (%s): "
                       "decode attention stays on gather + SDPA", exc)  # fmt: skip
        return False
    logger.info("CPU decode attention kernel %s ready in %.1f s (built on first use, then "
                "cached)", name, time.perf_counter() - start)  # fmt: skip
    return True


def paged_decode_attention(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32: keys of each row, this token's included
    scale: float,
) -> torch.Tensor:  # [B, H, D]
    """Each row's one query attending over its first seq_lens[b] cached keys (call
    `available()` first)."""
    return torch.ops.pdserve_cpu.paged_decode_attention(
        q.contiguous(), k_cache, v_cache, block_tables, seq_lens, scale
    )
