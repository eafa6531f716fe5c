"""pd-bench transfer --src-tp A --dst-tp B: every rank a process, each prefill rank's heads
straight to the decode ranks holding them, byte-exact beside the copy ceiling; sizes that do
not divide the model's kv heads, and flags the TP path has no use for, are clear errors."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from benchmarks.cli import main as pd_bench
from benchmarks.transfer.spec import TransferSpec, layout_for
from benchmarks.transfer.tp_ranks import rank_heads
from cache_transfer.tp import RankHeads

QUICK = ["--model", "llama3-8b:layers=2", "--prompt-tokens", "64", "--iters", "1"]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_tp_two_to_one_lands_byte_exact_beside_the_copy_rate() -> None:
    argv = [sys.executable, "-m", "benchmarks.cli", "transfer", "--transport", "tcp",
            "--src-tp", "2", "--dst-tp", "1", *QUICK]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=380)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert re.search(r"host copy \(memcpy\) \(ceiling\)\s+\d+\.\d\d\s+100%", out), out
    row = r"prefill TP 2 -> decode TP 1: every rank's heads\s+\d+\.\d\d\s+\d+%\s+0\.5\s+\d+\.\d\d"
    assert re.search(row, out), out
    assert "byte-exact: OK (1 requests x 2 layers, each decode rank's heads" in out


def test_rank_heads_are_the_engine_partition() -> None:
    spec = TransferSpec(layout_for("llama3-8b:layers=2"), 64, "tcp")
    assert rank_heads(spec, 2) == [RankHeads(0, 0, 4), RankHeads(1, 4, 8)]
    with pytest.raises(ValueError):
        rank_heads(spec, 3)  # 8 kv heads do not split over 3 ranks


def test_bad_tp_flags_are_errors(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        pd_bench(["transfer", "--src-tp", "3", *QUICK])
    assert "transfer: error:" in capsys.readouterr().err
    for bad in (["--dst-tp", "2", "--transport", "local"], ["--src-tp", "0", "--dst-tp", "2"]):
        with pytest.raises(SystemExit):
            pd_bench(["transfer", *bad, *QUICK])
        assert "--src-tp/--dst-tp need sizes >= 1" in capsys.readouterr().err
