"""kernels/gemm/cpu_packed.py: bf16 projections on CPU through oneDNN on weights packed once,
and PDSERVE_CPU_PACKED_GEMM."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kernels.gemm import cpu_packed
from pdserve import envs
from tests.env_vars import assert_env_reads

needs_bf16_cpu = pytest.mark.skipif(
    not cpu_packed.supported(torch.device("cpu"), torch.bfloat16),
    reason="this CPU has no bf16 instructions (AMX-BF16 / AVX512-BF16) or torch no oneDNN",
)


@pytest.mark.parametrize(
    "value, want", [(None, True), ("", True), ("1", True), ("0", False), ("yes", None)]
)
def test_env_var_parses(monkeypatch: pytest.MonkeyPatch, value, want) -> None:
    assert_env_reads(monkeypatch, "PDSERVE_CPU_PACKED_GEMM", value, want, envs.cpu_packed_gemm)


def test_only_bf16_on_cpu() -> None:
    cpu = torch.device("cpu")
    assert not cpu_packed.supported(cpu, torch.float32)  # fp32 keeps MKL (the exactness tests)
    assert not cpu_packed.supported(cpu, torch.float16)
    assert not cpu_packed.supported(torch.device("cuda"), torch.bfloat16)
    assert cpu_packed.supported(cpu, torch.bfloat16) == cpu_packed.native_bf16()


def test_linear_of_a_plain_weight_is_f_linear() -> None:
    x, w, b = torch.randn(3, 8), torch.randn(5, 8), torch.randn(5)
    assert torch.equal(cpu_packed.linear(x, w, b), F.linear(x, w, b))


@needs_bf16_cpu
@pytest.mark.parametrize("rows", [0, 1, 2, 7, 20, 32, 33, 300])
@pytest.mark.parametrize("n, k", [(960, 576), (576, 1536), (100, 64)])
def test_packed_linear_matches_f_linear(rows: int, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(rows * n + k)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    w = torch.randn(n, k, generator=gen).bfloat16()
    bias = torch.randn(n, generator=gen).bfloat16()
    packed = cpu_packed.pack(w)
    assert packed.is_mkldnn and packed.shape == w.shape and packed.dtype == torch.bfloat16
    for b in (None, bias):
        got = cpu_packed.linear(x, packed, b)
        assert got.shape == (rows, n) and got.dtype == torch.bfloat16
        # The same oneDNN kernel as F.linear's, which reorders the weight per call: the same
        # fp32 accumulation, so at most one bf16 rounding apart.
        torch.testing.assert_close(got, F.linear(x, w, b), rtol=1.6e-2, atol=1e-2)


@needs_bf16_cpu
def test_a_non_contiguous_input_is_taken() -> None:
    x = torch.randn(6, 64).bfloat16()[::2]
    w = torch.randn(16, 64).bfloat16()
    torch.testing.assert_close(cpu_packed.linear(x, cpu_packed.pack(w), None), F.linear(x, w))


@needs_bf16_cpu
def test_pack_projections_packs_every_linear_in_place() -> None:
    model = nn.Sequential(nn.Linear(8, 16, bias=False), nn.ReLU(), nn.Linear(16, 4)).bfloat16()
    shapes = [tuple(p.shape) for p in model.parameters()]
    assert cpu_packed.pack_projections(model) == 2
    assert all(m.weight.is_mkldnn for m in model if isinstance(m, nn.Linear))
    assert [tuple(p.shape) for p in model.parameters()] == shapes  # biases stay dense
    assert not model[2].bias.is_mkldnn
    assert cpu_packed.pack_projections(model) == 0  # already packed: nothing to do
