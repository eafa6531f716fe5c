"""The split decode's last-program merge, compiled for an H100/H200 (sm_90) without a GPU: the
PTX orders it as the protocol needs (the interpreter runs programs one by one and cannot).

Triton compiles ahead of time on CPU (its wheel ships ptxas); the kernel module is imported in
a child process with TRITON_INTERPRET=0, since this session's kernels are interpreted.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed")
ROOT = Path(__file__).parents[4]

COMPILE = """
import inspect, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels.attention.triton_paged_attention import paged_decode_kernel as k
names = list(inspect.signature(k.fn).parameters)
ptrs = dict(out_ptr="*bf16", partial_out_ptr="*fp32", partial_lse_ptr="*fp32",
            counters_ptr="*i32", q_ptr="*bf16", k_cache_ptr="*bf16", v_cache_ptr="*bf16",
            block_tables_ptr="*i32", seq_lens_ptr="*i32", scale_log2="fp32")
consts = dict(SINGLE_SPLIT=False, SPLITS_PAD=64, NUM_QUERIES_PER_KV=4, BLOCK_SIZE=16,
              HEAD_DIM=128, HEAD_DIM_PAD=128, BLOCK_G=16, BLOCK_N=64, DOT_PRECISION="tf32")
sig = {n: ptrs.get(n, "constexpr" if n in consts else "i32") for n in names}
src = ASTSource(fn=k, signature=sig, constexprs={(names.index(n),): v for n, v in consts.items()})
kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                        options=dict(num_warps=4, num_stages=3))
print(kernel.asm["ptx"])
"""


def test_merge_is_released_acquired_and_read_through_l2() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT),
           "TRITON_DEFAULT_FP_FUSION": "1"}  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line.strip() for line in result.stdout.splitlines()]
    ops = [line for line in lines if "st.global" in line or "bar.sync" in line
           or "atom.global" in line or "ld.global.cg" in line]  # fmt: skip
    adds = [i for i, op in enumerate(ops) if "atom.global.gpu.acq_rel.add" in op]
    assert len(adds) == 1, "one acq_rel add per program"
    add = adds[0]
    before, after = ops[:add], ops[add + 1 :]
    last_store = max(i for i, op in enumerate(before) if "st.global" in op)
    assert any("bar.sync" in op for op in before[last_store:]), "partials stored, barrier, add"
    first_load = next((i for i, op in enumerate(after) if "ld.global.cg" in op), None)
    assert first_load is not None, "the merge reads the partials through L2 (.cg)"
    assert any("bar.sync" in op for op in after[:first_load]), "add, barrier, merge loads"
    assert any("atom.global.gpu.relaxed.exch" in op for op in after[:first_load]), "reset"
    assert not any("st.global" in op for op in after[:first_load])
