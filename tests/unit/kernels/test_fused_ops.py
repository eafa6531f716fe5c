"""The fused per-layer Triton kernels (kernels/fused/triton_ops.py) against the torch reference,
on CPU through the Triton interpreter (tiny shapes); tests/gpu/test_fused_ops_gpu.py runs them
compiled at model sizes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated (imported)
pytest.importorskip("triton", reason="triton is not installed (pip install --no-deps triton)")

from kernels.fused import REFERENCE_OPS, get_layer_ops  # noqa: E402
from kernels.fused import triton_ops as tops  # noqa: E402
from tests.child_env import child_env  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16]


def _tol(dtype: torch.dtype) -> dict:
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}


def _randn(*shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [64, 48])  # a power of two and a padded width
def test_add_rms_norm_matches_reference(dtype, dim) -> None:
    x, res, w = (_randn(5, dim, dtype=dtype, seed=s) for s in (1, 2, 3))
    w = w.reshape(-1)[:dim].contiguous()
    want_out, want_res = REFERENCE_OPS.add_rms_norm(x, res.clone(), w, 1e-5)
    res_buf = res.clone()
    out, new_res = tops.add_rms_norm(x, res_buf, w, 1e-5)
    assert new_res.data_ptr() == res_buf.data_ptr(), "the sum is written into residual"
    # One rounding, as torch rounds (the CPU interpreter may truncate bf16 instead of rounding).
    exact = dtype == torch.float32 or DEVICE == "cuda"
    torch.testing.assert_close(
        new_res, want_res, **({"atol": 0, "rtol": 0} if exact else _tol(dtype))
    )
    torch.testing.assert_close(out, want_out, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_reference_on_heads(dtype) -> None:
    x = _randn(3, 4, 16, dtype=dtype, seed=4)  # Qwen3's per-head q/k norm shape
    w = _randn(16, dtype=dtype, seed=5)
    out = tops.rms_norm(x, w, 1e-6)
    assert out.shape == x.shape
    torch.testing.assert_close(out, REFERENCE_OPS.rms_norm(x, w, 1e-6), **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_qk_in_place_on_the_fused_qkv_buffer(dtype) -> None:
    num_tokens, heads, kv_heads, head_dim = 4, 4, 2, 16
    qkv = _randn(num_tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=6)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = (t.view(num_tokens, -1, head_dim) for t in (q, k, v))
    cos_sin = _randn(num_tokens, head_dim, dtype=dtype, seed=7)
    cos, sin = cos_sin.unsqueeze(1).chunk(2, dim=-1)
    want_q, want_k = REFERENCE_OPS.rotary_qk(q.clone(), k.clone(), cos, sin)
    v_before = v.clone()
    got_q, got_k = tops.rotary_qk(q, k, cos, sin)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()
    torch.testing.assert_close(got_q, want_q, **_tol(dtype))
    torch.testing.assert_close(got_k, want_k, **_tol(dtype))
    assert torch.equal(v, v_before), "v is not touched"


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_qk_write_kv_stores_the_rotated_k_and_v(dtype) -> None:
    num_tokens, heads, kv_heads, head_dim, block_size, num_blocks = 5, 4, 2, 16, 4, 6
    qkv = _randn(num_tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=9)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = (t.view(num_tokens, -1, head_dim) for t in (q, k, v))
    cos, sin = _randn(num_tokens, head_dim, dtype=dtype, seed=10).unsqueeze(1).chunk(2, dim=-1)
    slots = torch.tensor([3, 9, 10, 17, 0], device=DEVICE)  # scattered over blocks
    shape = (num_blocks, block_size, kv_heads, head_dim)
    want_caches = [torch.zeros(shape, dtype=dtype, device=DEVICE) for _ in range(2)]
    got_caches = [torch.zeros(shape, dtype=dtype, device=DEVICE) for _ in range(2)]
    want_q, want_k = REFERENCE_OPS.rotary_qk_write_kv(
        q.clone(), k.clone(), v, cos, sin, *want_caches, slots
    )
    got_q, got_k = tops.rotary_qk_write_kv(q, k, v, cos, sin, *got_caches, slots)
    torch.testing.assert_close(got_q, want_q, **_tol(dtype))
    torch.testing.assert_close(got_k, want_k, **_tol(dtype))
    torch.testing.assert_close(got_caches[0], want_caches[0], **_tol(dtype))
    assert torch.equal(got_caches[1], want_caches[1]), "v is copied unchanged"
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots.cpu()] = False
    assert not got_caches[0].view(-1, kv_heads, head_dim)[untouched].any(), "only the slots"
    assert torch.equal(got_caches[1].view(-1, kv_heads, head_dim)[slots], v)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_reference(dtype) -> None:
    x = _randn(3, 2 * 40, dtype=dtype, seed=8)
    torch.testing.assert_close(tops.silu_and_mul(x), REFERENCE_OPS.silu_and_mul(x), **_tol(dtype))


def test_empty_batches_launch_nothing() -> None:
    w = torch.ones(8, device=DEVICE)
    out, res = tops.add_rms_norm(
        torch.empty(0, 8, device=DEVICE), torch.empty(0, 8, device=DEVICE), w, 1e-5
    )
    assert out.shape == (0, 8) and res.shape == (0, 8)
    assert tops.silu_and_mul(torch.empty(0, 8, device=DEVICE)).shape == (0, 4)


def test_selection_follows_the_backend_and_device() -> None:
    assert get_layer_ops("torch", torch.device("cpu")).name == "reference"
    assert get_layer_ops("triton", torch.device("cpu")).name == "reference"
    if torch.cuda.is_available():
        assert get_layer_ops("triton", torch.device("cuda")).name == "triton"
        assert get_layer_ops("torch", torch.device("cuda")).name == "reference"


def test_add_rms_norm_rejects_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match="same|one"):
        tops.add_rms_norm(torch.zeros(2, 8, device=DEVICE), torch.zeros(3, 8, device=DEVICE),
                          torch.ones(8, device=DEVICE), 1e-5)  # fmt: skip


COMPILE_SCRIPT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels.fused import triton_ops as t

def compile_(fn, sig, consts):
    sig = {**sig, **{name: "constexpr" for name in consts}}
    triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts),
                   target=GPUTarget("cuda", 90, 32))

for dt, pdl in (("bf16", True), ("fp16", False), ("fp32", False)):  # pdl: launched with PDL
    ptrs = lambda *names: {n: "*" + dt for n in names}
    ints = lambda *names: {n: "i32" for n in names}
    compile_(t._rms_norm_kernel,
             {**ptrs("out_ptr", "x_ptr", "residual_ptr", "weight_ptr"), "eps": "fp32",
              **ints("n_cols", "stride_out", "stride_x", "stride_res")},
             {"HAS_RESIDUAL": True, "BLOCK": 4096, "USE_PDL": pdl})
    for write_kv, fp8 in ((True, False), (False, False), (True, True)):  # fp8: an FP8 cache
        cache = "*fp8e4nv" if fp8 else "*" + dt
        compile_(t._rotary_kernel,
                 {**ptrs("q_ptr", "k_ptr", "v_ptr", "cos_ptr", "sin_ptr"), "k_cache_ptr": cache,
                  "v_cache_ptr": cache, "slot_ptr": "*i64", "scale_ptr": "*fp32",
                  **ints("num_q_heads", "num_kv_heads", "stride_q_tok", "stride_q_head",
                         "stride_k_tok", "stride_k_head", "stride_v_tok", "stride_v_head",
                         "stride_cos", "stride_sin", "stride_cache_slot", "stride_cache_head")},
                 {"HALF": 64, "HALF_PAD": 64, "WRITE_KV": write_kv, "FP8": fp8, "USE_PDL": pdl})
    compile_(t._silu_and_mul_kernel,
             {**ptrs("out_ptr", "x_ptr"), **ints("d", "stride_out", "stride_x")},
             {"BLOCK": 1024, "USE_PDL": pdl})
print("ok")
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests/gpu runs the compiled kernels")
def test_kernels_compile_for_hopper_without_a_gpu() -> None:
    """The interpreter runs Python semantics; the compiler is stricter (branch types, constexpr
    use). Compile every kernel to a sm_90 cubin (Triton's bundled ptxas), no GPU needed."""
    env = child_env(drop=("TRITON_INTERPRET",))
    done = subprocess.run(
        [sys.executable, "-c", COMPILE_SCRIPT], env=env, capture_output=True, text=True,
        timeout=240,
    )  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
