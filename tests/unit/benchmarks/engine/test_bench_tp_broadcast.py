"""The step broadcast micro-benchmark runs on CPU (two processes, gloo) and prints both ways."""

from __future__ import annotations

import pytest

from benchmarks.engine.bench_tp_broadcast import CASES, main


def test_both_ways_are_measured_for_every_step_shape(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--steps", "5", "--rounds", "1"]) == 0
    table = capsys.readouterr().out
    for case in CASES:
        (row,) = [line for line in table.splitlines() if line.startswith(f"| {case.label} |")]
        cells = row.strip("|").split("|")
        assert len(cells) == 5 and all(" us" in c for c in cells[2:])
