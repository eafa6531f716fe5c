"""The decode split sweep's grid and tables on CPU (its timings need CUDA: it refuses to run
without)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.kernels import attention_split_sweep as sweep
from kernels.attention.decode_launch_config import DecodeLaunchConfig, default_policy_config

H200_SMS = 132


def test_main_fails_loudly_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        sweep.main(["--batches", "1", "--contexts", "1024"])


@pytest.mark.parametrize("context", [1024, 4096])
def test_small_batch_grid_has_both_policies_and_each_slicing_once(context: int) -> None:
    settings = sweep.split_settings(1, context, H200_SMS)
    assert [policy for policy, _ in settings[:2]] == ["default", "heuristic"]
    assert settings[0][1] == default_policy_config(torch.bfloat16)
    configs = [config for _, config in settings]
    assert len(set(configs)) == len(configs)
    slices = {config.num_slices(context) for _, config in settings[2:]}
    assert {1, 2, 4, 8, 32} <= slices  # 16 is the heuristic's own row at 1K, the default's at 4K


def test_large_batch_grid_has_the_unsplit_heuristic_beside_the_default() -> None:
    """Batch 128 x 8 kv heads fills an H200: the policy's row does not split, the former
    default's does (the sweep measures both)."""
    settings = sweep.split_settings(128, 1024, H200_SMS)
    assert [policy for policy, _ in settings[:2]] == ["default", "heuristic"]
    assert settings[1][1].max_splits == 1
    assert all(policy == "" for policy, _ in settings[2:])


def test_tile_phase_varies_the_tile_of_the_best_slicing() -> None:
    best = DecodeLaunchConfig(64, 33, 64, 4, 3)
    settings = sweep.tile_settings(best)
    assert len(settings) == len(sweep.TILES) - 1
    for _, config in settings:
        assert (config.min_partition_len, config.max_splits) == (64, 33)
        assert config != best
        assert config.num_stages == (2 if config.block_n == 128 else 3)


def test_tables_mark_the_fastest_correct_setting() -> None:
    layer = sweep.Layer(
        meta=None, q=torch.zeros(2, 32, 128), k=torch.zeros(2, 8, 128),
        caches=torch.zeros(1, 2, 1, 16, 8, 128), expected=torch.zeros(2, 32, 128),
        kv_bytes=4 << 20,
    )  # fmt: skip
    base = default_policy_config(torch.bfloat16)
    fast_wrong = DecodeLaunchConfig(32, 32, 32, 4, 3)
    best = DecodeLaunchConfig(64, 33, 64, 4, 3)
    rows = [
        sweep.Row("default", base, 10e-6, 1e-3),
        sweep.Row("heuristic", best, 4e-6, 1e-3),
        sweep.Row("", fast_wrong, 1e-6, 1.0),
        sweep.Row("", DecodeLaunchConfig(64, 33, 128, 8, 2), None, error="OutOfResources: smem"),
    ]
    text = sweep.table(rows, layer, 1024, copy_bps=4e12)
    lines = text.splitlines()
    assert lines[0].startswith("| setting |") and len(lines) == 2 + len(rows)
    assert "**best**" in lines[3] and best.label() in lines[3]
    assert "WRONG" in lines[4]
    assert "failed" in lines[5] and "OutOfResources" in lines[5]
    assert "| 4.0 | 1049 | 26% |" in lines[3]  # 4 MiB in 4 us; 4 TB/s copy rate
    summary = sweep.summary({(2, 1024): rows})
    assert "| 2 | 1024 | 10.0 | 4.0 | 2.50x | P64 S33 N64 w4 s3 | 4.0 |" in summary
