"""The skinny GEMM compiled for an H100/H200 (sm_90) without a GPU: the table's launches for the
llama3-8b shapes stream W and x through 16-byte cp.async into shared memory (pipelined, no
scalar global loads), use no atomics (deterministic; split-K launches too), and the 64 x 64
tiles use wgmma; the gated launch (the down projection taking gate | up) pipelines both halves
of x the same way.

Triton compiles ahead of time on CPU (its wheel ships ptxas); the kernel module is imported in a
child process with TRITON_INTERPRET=0, since this session's kernels are interpreted. The
divisibility hints are the ones Triton's launcher derives for these shapes (16-byte aligned
pointers; N, K and the row strides multiples of 16).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed")
ROOT = Path(__file__).parents[3]

COMPILE = """
import inspect, json, sys, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels.gemm import skinny_gemm_config
from kernels.gemm.skinny_config import fused_config
from kernels import pdl
from kernels.gemm.skinny_gemm import _skinny_gemm_kernel as k
names = list(inspect.signature(k.fn).parameters)
out = {}
for m, n, kdim, prologue in json.loads(sys.argv[1]):
    c = fused_config(m, n, kdim) or skinny_gemm_config(m, n, kdim)  # the engine's launch
    normed, with_pdl = "normed" in prologue, "pdl" in prologue
    pdl.set_enabled(with_pdl)
    consts = dict(HAS_BIAS=False, GATED="gated" in prologue, NORMED=normed, HAS_ADD=normed,
                  USE_DOT=c.use_dot, EVEN_K=kdim % c.block_k == 0,
                  DOT_PRECISION="tf32", UPCAST_DOT=False, SPLIT_K=c.split_k, BLOCK_M=c.tile_m(m),
                  USE_PDL=with_pdl, PREFETCH_LINES=pdl.prefetch_lines(m, c.block_n, c.k_per_split(kdim) * 2), LINE=64,
                  BLOCK_N=c.block_n, BLOCK_K=c.block_k, NUM_STAGES=c.num_stages)
    sig = {a: "constexpr" if a in consts else ("*bf16" if a.endswith("_ptr") else "i32")
           for a in names}
    sig["eps"], sig["ws_ptr"] = "fp32", "*fp32"  # ws: the split launches' fp32 partials
    aligned = [a for a in names if a.endswith("_ptr") or a in ("N", "K", "k_per_split")
               or a.startswith("stride")]  # k_per_split: whole BLOCK_K steps
    aligned += ["M"] if m % 16 == 0 else []
    src = ASTSource(fn=k, signature=sig,
                    constexprs={(names.index(a),): v for a, v in consts.items()},
                    attrs={(names.index(a),): [["tt.divisibility", 16]] for a in aligned})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=c.num_warps, num_stages=c.num_stages))
    out[f"{m},{n},{kdim},{prologue}"] = kernel.asm["ptx"]
print(json.dumps(out))
"""
CASES = [
    (1, 4096, 4096, ""),
    (1, 28672, 4096, ""),
    (8, 6144, 4096, ""),
    (32, 4096, 14336, ""),
    (128, 4096, 4096, ""),
    (32, 4096, 4096, ""),  # o_proj at 32 tokens: the split-K launch (MEASURED_WINS)
    (1, 4096, 14336, "gated"),  # the down projection with the SwiGLU on its gate | up loads
    (1, 6144, 4096, "normed"),  # QKV with the residual add + RMSNorm on its x loads
    (1, 28672, 4096, "normed"),  # gate_up, the same
    (32, 6144, 4096, "normed+pdl"),  # launched with PDL (kernels/pdl.py): W prefetched, then wait
    (32, 4096, 4096, "pdl"),
]


@pytest.fixture(scope="module")
def ptx() -> dict[str, str]:
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT),
           "TRITON_DEFAULT_FP_FUSION": "1"}  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-c", COMPILE, json.dumps(CASES)],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.parametrize("case", CASES)
def test_loads_are_pipelined_16_byte_copies_and_no_atomics(ptx, case) -> None:
    m, n, k, prologue = case
    code = ptx[f"{m},{n},{k},{prologue}"]
    # .cg: the 16-byte copies (W, and x from 8 tokens on); one token's x row goes in 4-byte .ca
    copies = [line for line in code.splitlines() if "cp.async.cg.shared.global" in line]
    assert copies and all(", 0x10," in line for line in copies), "16-byte cp.async for W"
    assert "cp.async.wait_group" in code, "a pipelined (multi-buffered) K loop"
    if prologue == "normed":  # the norm's pre-pass reads the row (from L2) before the loop
        main_loop = code[code.index("cp.async") :]
        assert "ld.global" not in main_loop, "the K loop's loads all go async"
    else:
        assert "ld.global" not in code, "no synchronous global loads (W and x both go async)"
    atomics = re.findall(r"^\s*(?:atom|red)\.", code, flags=re.MULTILINE)
    assert not atomics, "no atomics: one program per output"


@pytest.mark.parametrize("case", [c for c in CASES if "pdl" in c[3]])
def test_a_pdl_launch_prefetches_only_w_before_its_wait(ptx, case) -> None:
    """Launched with PDL, a program may run while the kernel before it still writes: before
    griddepcontrol.wait it only prefetches W (which no kernel writes) into L2; every load of x,
    the residual or the norm weight, and every store, comes after the wait; the next kernel is
    released after it."""
    code = ptx[",".join(map(str, case))]
    wait = code.index("griddepcontrol.wait")
    assert code.index("griddepcontrol.launch_dependents") > wait
    before = code[:wait]
    assert "prefetch.global.L2" in before, "W's first lines prefetched while waiting"
    loads = re.findall(r"\b(?:ld\.(?!param)|st\.|cp\.async\.)", before)  # ld.param: arguments
    assert not loads, "no load of memory and no store before the wait"
    assert "griddepcontrol" not in ptx["1,6144,4096,normed"], "no PDL code when launched plainly"


def test_large_tiles_use_wgmma(ptx) -> None:
    assert "wgmma.mma_async" in ptx["128,4096,4096,"]
    assert "mma.sync" in ptx["8,6144,4096,"]


def test_a_split_launch_is_among_the_cases() -> None:
    from kernels.gemm.skinny_config import fused_config

    assert fused_config(32, 4096, 4096).split_k > 1  # the (32, 4096, 4096) case above
