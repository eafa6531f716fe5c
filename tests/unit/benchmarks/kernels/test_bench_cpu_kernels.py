"""benchmarks/kernels/bench_cpu_kernels.py runs its kernel sections (one layer, one round) and prints
their rows."""

from __future__ import annotations

import pytest

from benchmarks.kernels import bench_cpu_kernels
from kernels.attention import cpu_paged_decode
from kernels.gemm import cpu_packed


def test_kernel_sections_print_their_rows(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    with torch.inference_mode():
        bench_cpu_kernels.projections(rounds=1, num_layers=1)
        bench_cpu_kernels.decode_attention(rounds=1)
    out = capsys.readouterr().out
    if cpu_packed.supported(torch.device("cpu"), torch.bfloat16):
        rows = [line.split() for line in out.splitlines() if line.strip()[:2] in ("1 ", "20", "32")]
        assert [r[0] for r in rows] == ["1", "20", "32"] and all(len(r) == 5 for r in rows)
    else:
        assert "skipped" in out
    assert "gather + SDPA:" in out and "GB/s of K and V" in out
    assert ("C++ kernel:" in out) == cpu_paged_decode.available()
