"""pd-bench router on this machine, in miniature: instant nodes and a pd-router in their own
processes; every request of every path answered in full (no errors, no hand-off timeouts),
both tables printed. Behaviour only: the numbers are the benchmark's business."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from benchmarks.router.bench_router import build_parser, variants


@pytest.mark.timeout(300)
def test_router_bench_runs_every_path_without_errors() -> None:
    argv = [sys.executable, "-m", "benchmarks.cli", "router", "--idle-requests", "12"]
    argv += ["--warmup", "3", "--rates", "20", "--duration-s", "0.5", "--slo-p99-ms", "10000"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=240)
    out = done.stdout
    assert done.returncode == 0, out[-3000:] + done.stderr[-3000:]
    for mode in ("pd", "colocated"):
        block = out.split(f"== mode {mode}:", 1)[1].split("== mode", 1)[0]
        for path in ("direct", "grpc", "http"):
            row = re.search(rf"^{path} +\|(.+)$", block, re.M)
            assert row, block
            cells = [c.strip() for c in row.group(1).split("|")]
            assert cells[4] == "0", block  # errors
        assert block.count("added by the router") == 2, block
        steps = re.findall(r"^ +20 \| +\d+ \| +(\d+) \|", block, re.M)  # the 20/s step's errors
        assert steps == ["0", "0"], block  # gRPC and HTTP
        assert re.search(r"over \d+ calls, 0 hand-off timeouts", block), block


def test_variants_alternate_baseline_checkout_and_extra_flags(tmp_path) -> None:
    """--baseline runs main's router (its tree first on PYTHONPATH), --variant-arg this
    checkout's again with the extra flags; every variant keeps --router-arg."""
    args = build_parser().parse_args(
        ["--baseline", str(tmp_path), "--router-arg=--log-level=warning",
         "--variant-arg=--event-loop=uvloop"]
    )  # fmt: skip

    (base_label, base_cmd, base_args), checkout, extra = variants(args)

    assert base_label == f"baseline {tmp_path}" and base_cmd is not None
    assert f"PYTHONPATH={tmp_path}" in base_cmd and base_cmd[-2:] == ["-m", "router.cli"]
    assert base_args == ["--log-level=warning"]
    assert checkout == ("this checkout", None, ["--log-level=warning"])
    assert extra == ("this checkout", None, ["--log-level=warning", "--event-loop=uvloop"])
    assert variants(build_parser().parse_args([])) == [("this checkout", None, [])]
