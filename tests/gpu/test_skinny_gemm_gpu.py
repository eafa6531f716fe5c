"""The skinny GEMM (kernels/gemm) compiled on the GPU at llama3-8b sizes: close to F.linear
(cuBLAS), bitwise the same from run to run and under CUDA-graph replay. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.gemm import MAX_M

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available"),
]
LLAMA3_8B_NK = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]


def _inputs(m, n, k, dtype, bias=False):
    gen = torch.Generator(device="cuda").manual_seed(m * 7 + n)
    x = torch.randn(m, k, device="cuda", generator=gen).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=gen) * k**-0.5).to(dtype)
    b = torch.randn(n, device="cuda", generator=gen).to(dtype) if bias else None
    return x, w, b


@pytest.mark.parametrize("n, k", LLAMA3_8B_NK)
@pytest.mark.parametrize("m", [1, 7, 16, 33, 64, MAX_M])
def test_llama3_8b_shapes_match_cublas_and_repeat_bitwise(n, k, m) -> None:
    from kernels.gemm.skinny_gemm import skinny_linear

    x, w, _ = _inputs(m, n, k, torch.bfloat16)
    y = skinny_linear(x, w)
    want = F.linear(x, w)
    torch.testing.assert_close(y, want, atol=3e-2, rtol=2e-2)
    assert torch.equal(y, skinny_linear(x, w)), "no atomics: bitwise repeatable"


@pytest.mark.parametrize("n, k", [(6144, 4096), (4096, 4096), (4096, 14336)])
@pytest.mark.parametrize("m", [32, 100, MAX_M])
@pytest.mark.parametrize("split", [2, 3, 4])
def test_split_k_matches_cublas_repeats_bitwise_and_replays(n, k, m, split) -> None:
    """K split over programs, fp32 partials summed by the reduce launch in split order: close
    to cuBLAS, bitwise the same every run and under CUDA-graph replay (the workspace from the
    graph's pool)."""
    from kernels.gemm import SkinnyGemmConfig
    from kernels.gemm.skinny_gemm import skinny_linear

    config = SkinnyGemmConfig(64, 64, 4, 4, block_m=64, split_k=split)
    x, w, b = _inputs(m, n, k, torch.bfloat16, bias=True)
    y = skinny_linear(x, w, b, config)
    torch.testing.assert_close(y, F.linear(x, w, b), atol=3e-2, rtol=2e-2)
    assert torch.equal(y, skinny_linear(x, w, b, config))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = skinny_linear(x, w, b, config)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, skinny_linear(x, w, b, config)) and not torch.equal(out, y)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_other_dtypes_with_bias(dtype) -> None:
    from kernels.gemm.skinny_gemm import skinny_linear

    x, w, b = _inputs(5, 6144, 4096, dtype, bias=True)
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 2e-2}
    want = x.double() @ w.double().t() + b.double()
    torch.testing.assert_close(skinny_linear(x, w, b).double(), want, **tol)


def test_cuda_graph_replay_equals_eager() -> None:
    from kernels.gemm.skinny_gemm import skinny_linear

    x, w, _ = _inputs(8, 4096, 14336, torch.bfloat16)
    eager = skinny_linear(x, w)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = skinny_linear(x, w)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, skinny_linear(x, w)) and not torch.equal(out, eager)


@pytest.mark.parametrize("m", [1, 7, 33])
def test_gated_down_projection_equals_silu_and_mul_then_the_gemm(m) -> None:
    """llama3-8b's down projection with the SwiGLU on its loads: bitwise the two launches."""
    from kernels.fused.triton_ops import silu_and_mul
    from kernels.gemm.skinny_gemm import skinny_linear

    gate_up, w, _ = _inputs(m, 4096, 2 * 14336, torch.bfloat16)
    w = w[:, :14336].contiguous()
    fused = skinny_linear(gate_up, w, gated=True)
    assert torch.equal(fused, skinny_linear(silu_and_mul(gate_up), w))
    torch.testing.assert_close(fused, F.linear(silu_and_mul(gate_up), w), atol=3e-2, rtol=2e-2)


def test_routed_gated_linear_fuses_only_measured_wins() -> None:
    from kernels.fused.triton_ops import silu_and_mul
    from kernels.gemm.skinny_config import measured_win
    from kernels.gemm.skinny_gemm import skinny_linear
    from kernels.gemm.skinny_routing import routed_gated_linear

    gate_up, w, _ = _inputs(1, 4096, 2 * 14336, torch.bfloat16)
    w = w[:, :14336].contiguous()
    routed = routed_gated_linear(gate_up, w, max_m=MAX_M, silu_and_mul=silu_and_mul)
    config = measured_win(1, 4096, 14336)
    assert torch.equal(routed, skinny_linear(gate_up, w, None, config, gated=True))  # measured
    two = torch.cat([gate_up, gate_up])
    routed = routed_gated_linear(two, w, max_m=MAX_M, silu_and_mul=silu_and_mul)
    assert torch.equal(routed, F.linear(silu_and_mul(two), w))  # two tokens: cuBLAS


@pytest.mark.parametrize("n", [6144, 28672])  # llama3-8b's QKV and gate_up
@pytest.mark.parametrize("m", [1, 5])
def test_normed_projection_close_to_add_rms_norm_then_cublas(n, m) -> None:
    """The residual add + RMSNorm in the GEMM's loads: the new residual bitwise the norm
    kernel's, the projection within bf16 rounding of add_rms_norm + F.linear, bitwise the same
    from run to run and under CUDA-graph replay."""
    from kernels.fused.triton_ops import add_rms_norm
    from kernels.gemm.skinny_config import fused_config
    from kernels.gemm.skinny_gemm import skinny_norm_linear

    x, w, _ = _inputs(m, n, 4096, torch.bfloat16)
    residual = torch.randn_like(x) * 4
    norm_w = torch.rand(4096, device="cuda").to(torch.bfloat16) + 0.5
    config = fused_config(m, n, 4096)  # the engine's launch at one token, the table's at 5
    y, summed = skinny_norm_linear(x, residual, norm_w, 1e-5, w, None, config)
    normed, want_sum = add_rms_norm(x, residual.clone(), norm_w, 1e-5)
    assert torch.equal(summed, want_sum)
    torch.testing.assert_close(y, F.linear(normed, w), atol=3e-2, rtol=2e-2)
    again, _ = skinny_norm_linear(x, residual, norm_w, 1e-5, w, None, config)
    assert torch.equal(y, again)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed, _ = skinny_norm_linear(x, residual, norm_w, 1e-5, w, None, config)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, y)
