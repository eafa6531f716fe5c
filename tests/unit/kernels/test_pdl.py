"""kernels/pdl.py's host-side policy: which launches go with programmatic dependent launch (the
kernels' PDL code is checked in test_skinny_gemm_ptx.py / test_fused_ops.py for sm_90, and run
in tests/gpu/test_pdl_gpu.py), and PDSERVE_PDL."""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install --no-deps triton)")

from kernels import pdl  # noqa: E402
from kernels.gemm import SkinnyGemmConfig  # noqa: E402
from pdserve import envs  # noqa: E402
from tests.env_vars import assert_env_reads  # noqa: E402


@pytest.fixture(autouse=True)
def _restore():
    yield
    pdl.set_enabled(False, prefetch_bytes=16 * 1024)


def test_plain_launches_while_off_and_outside_the_measured_token_range() -> None:
    plain, chained = {"USE_PDL": False}, {"USE_PDL": True, "launch_pdl": True}
    pdl.set_enabled(False)
    assert pdl.options(32) == plain
    pdl.set_enabled(True)
    assert pdl.options(pdl.MIN_TOKENS - 1) == plain
    assert pdl.options(pdl.MIN_TOKENS) == pdl.options(32) == pdl.options(pdl.MAX_TOKENS) == chained
    assert pdl.options(pdl.MAX_TOKENS + 1) == plain


def test_supported_needs_hopper() -> None:
    assert not pdl.supported((8, 9))
    assert pdl.supported((9, 0)) == hasattr(pdl.tl.extra.cuda, "gdc_wait")


def test_prefetch_is_a_power_of_two_of_lines_within_the_budget_and_the_k_run() -> None:
    config = SkinnyGemmConfig(64, 128, 4, 3, block_m=128, split_k=4)  # K run 1024 of 4096

    def lines(m: int) -> int:  # as the skinny GEMM asks, bf16 W
        return pdl.prefetch_lines(m, config.block_n, config.k_per_split(4096) * 2)

    pdl.set_enabled(True, prefetch_bytes=16 * 1024)
    assert lines(32) == 2  # 16 KiB over 64 rows: 256 bytes, two 128-byte lines per row
    pdl.set_enabled(True, prefetch_bytes=1 << 30)
    assert lines(32) == 16  # capped by the 1024-column K run (2 KiB a row)
    pdl.set_enabled(True, prefetch_bytes=48 * 1024)
    assert lines(32) == 4  # 6 lines fit: the power of two below
    assert lines(1) == 0  # one token: launched plainly
    pdl.set_enabled(False)
    assert lines(32) == 0
    with pytest.raises(ValueError, match="prefetch_bytes"):
        pdl.set_enabled(True, prefetch_bytes=-1)


@pytest.mark.parametrize("value, want", [(None, True), ("", True), ("1", True), ("0", False),
                                         (" 0 ", False), ("yes", None)])  # fmt: skip
def test_env_var_parses(monkeypatch: pytest.MonkeyPatch, value, want) -> None:
    assert_env_reads(monkeypatch, "PDSERVE_PDL", value, want, envs.dependent_launch)


def test_chain_wins_count_only_for_launches_with_pdl() -> None:
    from kernels.gemm.skinny_config import CHAIN_WINS, MEASURED_WINS, chain_win, measured_win

    for max_m, n, k, config in CHAIN_WINS:
        assert pdl.MIN_TOKENS <= max_m <= pdl.MAX_TOKENS
        assert chain_win(max_m, n, k) == config  # each row is the first of its (N, K) to fit
        assert (max_m, n, k) in MEASURED_WINS or measured_win(max_m, n, k) is None
    assert measured_win(20, 6144, 4096, chained=True) == chain_win(32, 6144, 4096)  # 17..32
    assert chain_win(20, 4096, 4096) is None  # o_proj has a row at 8 tokens only
    assert chain_win(pdl.MAX_TOKENS + 1, 6144, 4096) is None
    for (m, n, k), config in MEASURED_WINS.items():
        assert measured_win(m, n, k, chained=True) == config  # an exact win comes first
