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
    assert torch.equal(y, skinny_linear(x, w)), "no split-K, no atomics: bitwise repeatable"


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
