"""The skinny GEMM sweep's grid and tables on CPU (its timings need CUDA: it refuses to run
without)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.kernels import gemm_sweep as sweep
from kernels.gemm import SkinnyGemmConfig, skinny_gemm_config


def test_main_fails_loudly_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        sweep.main(["--shapes", "o_proj", "--ms", "1"])


def test_unknown_shape_is_refused() -> None:
    with pytest.raises(SystemExit):
        sweep.main(["--shapes", "nope"])


@pytest.mark.parametrize("name", list(sweep.SHAPES))
@pytest.mark.parametrize("m", [1, 8, 64, 128])
def test_grid_starts_with_the_table_and_holds_each_launch_once(name, m) -> None:
    n, k = sweep.SHAPES[name]
    found = sweep.settings(m, n, k, "full")
    assert found[0] == ("table", skinny_gemm_config(m, n, k))
    assert all(label == "" for label, _ in found[1:]) and len(found) > 4
    keys = [sweep.launch_key(config, m) for _, config in found]
    assert len(set(keys)) == len(keys)
    for _, config in found[1:]:
        assert config.fits(m) and config.num_programs(m, n) >= sweep.MIN_PROGRAMS
    assert any(not c.use_dot for _, c in found) == (m <= 4)
    assert sweep.settings(m, n, k, "table") == found[:1]


def test_summary_and_table_rows() -> None:
    best = SkinnyGemmConfig(32, 256, 4, 3, block_m=128)
    wrong = SkinnyGemmConfig(16, 512, 4, 3, block_m=128)
    table = skinny_gemm_config(1, 4096, 4096)
    rows = [
        sweep.Row("cublas", None, 10e-6),
        sweep.Row("table", table, 9e-6, max_err=1e-2),
        sweep.Row("", best, 8e-6, max_err=1e-2),
        sweep.Row("", wrong, 1e-6, max_err=1.0),  # fast but wrong: never the best
        sweep.Row("", SkinnyGemmConfig(64, 64, 4, 3), None, error="OutOfResources: smem"),
    ]
    result = sweep.Result("o_proj", 1, num_bytes=32 << 20, ref_max=4.0, rows=rows)
    text = sweep.summary([result], copy_bps=4e12)
    lines = text.splitlines()
    assert len(lines) == 3 and lines[0].startswith("| shape | M |")
    # 32 MiB in 10 us = 3.36 TB/s (84% of 4 TB/s); in 8 us 4.19 TB/s; 10 / 8 = 1.25x
    assert "| o_proj 4096x4096 | 1 | 10.0 | 3.36 | 84% | 9.0 | 3.73 | 93% |" in lines[2]
    assert f"| {best.label()} | 8.0 | 4.19 | 105% | 1.25x | 1.0e-02 | 2 |" in lines[2]
    code = sweep.table_rows([result]).strip()
    assert code == f"(1, 4096, 4096, {sweep.config_code(best)}),"
    assert eval(code[:-1], {"SkinnyGemmConfig": SkinnyGemmConfig})[3] == best
    assert "WRONG" in sweep.details(result) and "failed: OutOfResources" in sweep.details(result)
