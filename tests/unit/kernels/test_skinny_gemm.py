"""The skinny GEMM (kernels/gemm) against torch's matmul with float32 accumulation, on CPU
through the Triton interpreter (tiny shapes, sizes that are not multiples of the tiles);
tests/gpu/test_skinny_gemm_gpu.py runs it compiled at llama3-8b sizes."""

from __future__ import annotations

import os
import re

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated (imported)
pytest.importorskip("triton", reason="triton is not installed (pip install --no-deps triton)")

from kernels.gemm import MAX_M, SkinnyGemmConfig, skinny_gemm_config  # noqa: E402
from kernels.gemm.skinny_gemm import skinny_linear  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (M, N, K): none a multiple of every tile; M = 40 spans 3 M tiles of 16, 10 of 4
SHAPES = [(1, 40, 72), (3, 33, 100), (17, 50, 64), (40, 24, 48)]
SMALL_TILES = {
    "dot": SkinnyGemmConfig(16, 32, 4, 2, block_m=16),
    "fma": SkinnyGemmConfig(8, 32, 4, 2, block_m=4, use_dot=False),
    "table": None,  # skinny_gemm_config(M, N, K): large tiles, K and N masked
}
# split-K: K in runs of whole BLOCK_K steps, fp32 partials summed by a second launch; with
# 3 splits of K = 48 or 100 in 32-steps one run is empty (its partial is zeros)
SPLIT_TILES = {
    "dot_split3": SkinnyGemmConfig(16, 32, 4, 2, block_m=16, split_k=3),
    "fma_split2": SkinnyGemmConfig(8, 32, 4, 2, block_m=4, use_dot=False, split_k=2),
}
LLAMA3_8B_NK = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]


def _tol(dtype: torch.dtype) -> dict:
    # Low precision: the output's one rounding (the interpreter truncates) and the sum order.
    return {"atol": 1e-4, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}


def _randn(*shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(DEVICE, dtype)


def _reference(x, weight, bias):
    y = x.float() @ weight.float().t()
    return y if bias is None else y + bias.float()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("tiles", list(SMALL_TILES) + list(SPLIT_TILES))
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_float32_matmul(dtype, shape, tiles, with_bias) -> None:
    m, n, k = shape
    x, weight = _randn(m, k, dtype=dtype, seed=1), _randn(n, k, dtype=dtype, seed=2)
    bias = _randn(n, dtype=dtype, seed=3) if with_bias else None
    y = skinny_linear(x, weight, bias, {**SMALL_TILES, **SPLIT_TILES}[tiles])
    assert y.shape == (m, n) and y.dtype == dtype
    torch.testing.assert_close(y.float(), _reference(x, weight, bias), **_tol(dtype))


def test_strided_rows_of_x_and_weight() -> None:
    """Row strides are free (a slice of a wider buffer); only K must be contiguous."""
    x_buf, w_buf = (
        _randn(5, 80, dtype=torch.float16, seed=4),
        _randn(30, 96, dtype=torch.float16, seed=5),
    )
    x, weight = x_buf[:, :72], w_buf[:, 8:80]
    assert not x.is_contiguous() and not weight.is_contiguous()
    y = skinny_linear(x, weight, None, SMALL_TILES["dot"])
    torch.testing.assert_close(y.float(), _reference(x, weight, None), **_tol(torch.float16))


def test_no_tokens_gives_an_empty_result() -> None:
    x, weight = torch.empty(0, 64, device=DEVICE), _randn(32, 64, dtype=torch.float32, seed=6)
    assert skinny_linear(x, weight).shape == (0, 32)


def _bad_inputs():
    w = torch.zeros(32, 64)
    yield "x [M, K] and weight [N, K]", torch.zeros(2, 48), w, None
    yield "x [M, K] and weight [N, K]", torch.zeros(1, 2, 64), w, None
    yield (
        "one dtype among float16, bfloat16, float32",
        torch.zeros(2, 64, dtype=torch.float64),
        w.double(),
        None,
    )
    yield "one dtype among", torch.zeros(2, 64, dtype=torch.float16), w, None
    yield f"at most {MAX_M} rows", torch.zeros(MAX_M + 1, 64), w, None
    yield "contiguous K dim", torch.zeros(64, 2).t(), w, None
    yield "contiguous K dim", torch.zeros(2, 64), torch.zeros(64, 32).t(), None
    yield "bias [N=32]", torch.zeros(2, 64), w, torch.zeros(31)
    yield "bias [N=32]", torch.zeros(2, 64), w, torch.zeros(32, dtype=torch.float16)
    yield "contiguous bias", torch.zeros(2, 64), w, torch.zeros(64)[::2]


@pytest.mark.parametrize("message, x, weight, bias", list(_bad_inputs()))
def test_bad_input_is_refused_with_a_clear_error(message, x, weight, bias) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        skinny_linear(x, weight, bias)


@pytest.mark.parametrize("n, k", LLAMA3_8B_NK)
def test_table_has_a_fitting_launch_for_every_m(n, k) -> None:
    """Every M of 1..MAX_M gets a launch within shared memory (and registers without tl.dot)
    with at least 64 programs (half an H200's 132 SMs: the table does not split K, so the N tiles
    must fill it)."""
    for m in range(1, MAX_M + 1):
        config = skinny_gemm_config(m, n, k)
        assert config.fits(m), (m, n, k, config.label())
        assert config.num_programs(m, n) >= 64, (m, n, k, config.label())
    with pytest.raises(ValueError, match=f"1 <= M <= {MAX_M}"):
        skinny_gemm_config(MAX_M + 1, n, k)
    with pytest.raises(ValueError, match=f"1 <= M <= {MAX_M}"):
        skinny_gemm_config(0, n, k)


def test_m_tile_is_padded_for_dot_and_capped_by_block_m() -> None:
    dot = SkinnyGemmConfig(64, 64, 4, 4, block_m=64)
    assert [dot.tile_m(m) for m in (1, 16, 17, 64, 65, 128)] == [16, 16, 32, 64, 64, 64]
    assert dot.num_programs(128, 4096) == 2 * 64
    fma = SkinnyGemmConfig(16, 256, 4, 4, block_m=4, use_dot=False)
    assert [fma.tile_m(m) for m in (1, 2, 3, 5)] == [1, 2, 4, 4]


def test_split_k_multiplies_the_programs_and_runs_whole_k_steps() -> None:
    split = SkinnyGemmConfig(64, 64, 4, 4, block_m=64, split_k=4)
    assert split.num_programs(128, 4096) == 2 * 64 * 4
    assert split.k_per_split(14336) == 3584  # 224 steps of 64: 56 per split
    assert split.k_per_split(100) == 64  # 2 steps in 4 splits: 1 each, two runs empty
    assert SkinnyGemmConfig(64, 64, 4, 4).k_per_split(14336) == 14336
    assert "split4" in split.label() and "split" not in SkinnyGemmConfig(64, 64, 4, 4).label()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"block_n": 24, "block_k": 64}, "power of two"),
        ({"block_n": 8, "block_k": 64}, "tl.dot needs"),
        ({"block_n": 64, "block_k": 64, "num_warps": 3}, "num_warps"),
        ({"block_n": 64, "block_k": 64, "split_k": 0}, "split_k must be in 1..16"),
        ({"block_n": 64, "block_k": 64, "split_k": 17}, "split_k must be in 1..16"),
    ],
)
def test_bad_config_is_refused(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        SkinnyGemmConfig(num_warps=kwargs.pop("num_warps", 4), num_stages=3, **kwargs)


def test_routed_linear_takes_small_half_precision_steps_only(monkeypatch) -> None:
    """PDSERVE_SKINNY_GEMM_MAX_M's switch: 1..max_m rows of fp16/bf16 run the skinny GEMM (a
    win recorded for every shape here), anything else F.linear; results agree either way."""
    from kernels.gemm import skinny_routing

    monkeypatch.setattr(
        skinny_routing,
        "measured_win",
        lambda m, n, k, chained=False: skinny_gemm_config(m, n, k),
    )

    calls: list[tuple[int, ...]] = []
    real = skinny_routing.skinny_linear

    def spy(x, weight, bias=None, config=None):
        calls.append(tuple(x.shape))
        return real(x, weight, bias, config)

    monkeypatch.setattr(skinny_routing, "skinny_linear", spy)
    weight, bias = (
        _randn(24, 40, dtype=torch.bfloat16, seed=7),
        _randn(24, dtype=torch.bfloat16, seed=8),
    )
    for m, dtype, routed in [(1, torch.bfloat16, True), (4, torch.float16, True),
                             (5, torch.bfloat16, False), (2, torch.float32, False)]:  # fmt: skip
        calls.clear()
        x = _randn(m, 40, dtype=dtype, seed=m)
        y = skinny_routing.routed_linear(x, weight.to(dtype), bias.to(dtype), max_m=4)
        assert calls == ([(m, 40)] if routed else []), (m, dtype)
        want = torch.nn.functional.linear(x.float(), weight.float(), bias.float())
        torch.testing.assert_close(y.float(), want, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("tiles", list(SMALL_TILES) + list(SPLIT_TILES))
def test_gated_equals_silu_and_mul_then_the_gemm(dtype, shape, tiles) -> None:
    """The SwiGLU computed on the loaded tiles is rounded where silu_and_mul rounds: the gated
    GEMM gives exactly the two launches' values (split K too: the same runs, the same sums)."""
    from kernels.fused import triton_ops

    m, n, k = shape
    gate_up, weight = _randn(m, 2 * k, dtype=dtype, seed=7), _randn(n, k, dtype=dtype, seed=8)
    config = {**SMALL_TILES, **SPLIT_TILES}[tiles]
    fused = skinny_linear(gate_up, weight, None, config, gated=True)
    two_launches = skinny_linear(triton_ops.silu_and_mul(gate_up), weight, None, config)
    assert torch.equal(fused, two_launches)


def test_gated_needs_gate_and_up_of_the_weights_k() -> None:
    weight = torch.zeros(32, 64)
    with pytest.raises(ValueError, match=re.escape("x [M, 2K] (gate | up)")):
        skinny_linear(torch.zeros(2, 64), weight, gated=True)
    with pytest.raises(ValueError, match=re.escape("x [M, 2K] (gate | up)")):
        skinny_linear(torch.zeros(128), weight, gated=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("tiles", list(SMALL_TILES))
@pytest.mark.parametrize("with_add", [True, False])
def test_normed_equals_add_rms_norm_then_the_gemm(dtype, shape, tiles, with_add) -> None:
    """The residual add + RMSNorm computed on the loaded tiles: the sum bitwise the norm
    kernel's, the projection that of the two launches up to the input's rounding (1 / rms
    scales the accumulator instead of the input)."""
    from kernels.fused import triton_ops
    from kernels.gemm.skinny_gemm import skinny_norm_linear

    m, n, k = shape
    x, residual = _randn(m, k, dtype=dtype, seed=9), _randn(m, k, dtype=dtype, seed=10)
    norm_w, weight = _randn(k, dtype=dtype, seed=11), _randn(n, k, dtype=dtype, seed=12)
    bias = _randn(n, dtype=dtype, seed=13)
    config = SMALL_TILES[tiles]
    before = residual.clone()
    y, summed = skinny_norm_linear(
        x if with_add else None, residual, norm_w, 1e-5, weight, bias, config
    )
    if with_add:
        normed, want_sum = triton_ops.add_rms_norm(x, before.clone(), norm_w, 1e-5)
        assert torch.equal(summed, want_sum) and torch.equal(residual, before)  # a new tensor
    else:
        normed, want_sum = triton_ops.rms_norm(before, norm_w, 1e-5), before
        assert summed is residual and torch.equal(residual, before)
    two_launches = skinny_linear(normed, weight, bias, config)
    assert y.shape == (m, n) and y.dtype == dtype
    # Against the exact math on the (bitwise-checked) sum: no less accurate than the two launches
    s = want_sum.double()
    exact = (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5) * norm_w.double()) @ (
        weight.double().t()
    ) + bias.double()
    err, err_two = ((t.double() - exact).abs().max().item() for t in (y, two_launches))
    assert err <= 1.5 * err_two + 1e-4, (err, err_two)
    torch.testing.assert_close(y.float(), two_launches.float(), atol=0.13, rtol=2e-2)


def test_normed_checks_the_norm_inputs() -> None:
    from kernels.gemm.skinny_gemm import skinny_norm_linear

    residual, weight = torch.zeros(2, 64), torch.zeros(32, 64)
    with pytest.raises(ValueError, match="the fused RMSNorm needs the whole of K"):
        skinny_norm_linear(None, residual, torch.zeros(64), 1e-5, weight, None,
                           SPLIT_TILES["dot_split3"])  # fmt: skip
    with pytest.raises(ValueError, match=re.escape("the norm's weight must be [K=64]")):
        skinny_norm_linear(None, residual, torch.zeros(32), 1e-5, weight)
    with pytest.raises(ValueError, match="must match the residual"):
        skinny_norm_linear(torch.zeros(3, 64), residual, torch.zeros(64), 1e-5, weight)


def test_a_split_launch_never_takes_the_norm(monkeypatch) -> None:
    """A split-K launch recorded for a shape that a normed projection also has (the norm needs
    all of K in one program): routed_norm_linear declines (the caller runs the norm, then the
    split GEMM), the gated down projection takes it."""
    from kernels.fused import triton_ops
    from kernels.gemm import skinny_routing

    split = SPLIT_TILES["dot_split3"]
    monkeypatch.setattr(skinny_routing, "fused_config", lambda m, n, k: split)
    residual, weight = (
        _randn(2, 64, dtype=torch.bfloat16, seed=14),
        _randn(40, 64, dtype=torch.bfloat16, seed=15),
    )
    norm_w = _randn(64, dtype=torch.bfloat16, seed=16)
    assert skinny_routing.routed_norm_linear(None, residual, norm_w, 1e-5, weight, max_m=4) is None
    gate_up = _randn(2, 128, dtype=torch.bfloat16, seed=17)
    y = skinny_routing.routed_gated_linear(
        gate_up, weight, max_m=4, silu_and_mul=triton_ops.silu_and_mul
    )
    assert torch.equal(y, skinny_linear(triton_ops.silu_and_mul(gate_up), weight, None, split))
