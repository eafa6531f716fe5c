"""pd-bench serve / compare flags, cluster specs, and that the client side stays torch-free."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from benchmarks.serve import bench_compare, bench_serve
from benchmarks.serve.cluster import BenchCluster, ClusterSpec


def test_serve_client_imports_no_torch() -> None:
    code = (
        "import sys, benchmarks.cli, benchmarks.serve.bench_serve, benchmarks.serve.bench_compare, "
        "benchmarks.serve.bench_dataset, benchmarks.serve.bench_ttft, "
        "benchmarks.serve.bench_turn_ttft; "
        "print(sorted(m for m in ('torch', 'numpy', 'engine', 'kernels', 'matplotlib') "
        "if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.strip() == "[]"


def test_cluster_specs() -> None:
    assert ClusterSpec.parse("1P1D") == ClusterSpec("1P1D", 1, 1)
    assert ClusterSpec.parse("2p4d") == ClusterSpec("2p4d", 2, 4)
    assert ClusterSpec.parse("colocated") == ClusterSpec("colocated", 0, 1)
    assert ClusterSpec.parse("colocated:2") == ClusterSpec("colocated:2", 0, 2)
    for bad in ("1P0D", "P1D", "colo", "colocated:x", "1P1D2"):
        with pytest.raises(ValueError):
            ClusterSpec.parse(bad)


def test_cluster_forwards_flags_and_picks_a_free_port(tmp_path) -> None:
    cluster = BenchCluster(ClusterSpec.parse("colocated:2"), ["--model", "m"], tmp_path / "l", 1)
    argv = cluster.argv()
    assert argv[1:] == ["-m", "pdserve.local_cluster", "--prefill", "0", "--decode", "2",
                        "--port", "0", "--http-port", "0", "--model", "m"]  # fmt: skip
    given = BenchCluster(ClusterSpec.parse("1P1D"), ["--port=5", "--http-port", "8"], tmp_path, 1)
    assert given.argv()[-7:] == ["--prefill", "1", "--decode", "1", "--port=5", "--http-port", "8"]
    assert BenchCluster(None, ["--prefill", "0"]).argv()[3:] == [
        "--port", "0", "--http-port", "0", "--prefill", "0"]  # fmt: skip


def test_serve_flags_and_pd_serve_passthrough() -> None:
    parser = bench_serve.build_parser()
    args, extra = parser.parse_known_args(
        ["--request-rate", "1,inf", "--model", "smollm2-135m", "--device", "cpu", "--seed", "3"]
    )
    assert args.request_rate == [1.0, math.inf] and args.seed == 3
    assert extra == ["--model", "smollm2-135m", "--device", "cpu"]
    bench_serve.check_flags(parser, args, extra)  # valid pd-serve flags pass


@pytest.mark.parametrize(
    "argv",
    [
        ["--request-rate", "0"],
        ["--num-prompts", "0"],
        ["--addr", "127.0.0.1:1", "--model", "x"],  # pd-serve flags without a pd-serve
        ["--no-such-flag", "1"],  # neither pd-bench's nor pd-serve's
        ["--burstiness", "0"],
    ],
)
def test_bad_serve_flags_exit_2(argv, capsys) -> None:
    assert _exit_code(bench_serve.main, argv) == 2


def test_compare_needs_two_configs(capsys) -> None:
    assert _exit_code(bench_compare.main, ["--configs", "1P1D"]) == 2
    assert "at least two" in capsys.readouterr().err
    assert _exit_code(bench_compare.main, ["--configs", "1P1D,3X"]) == 2


def test_help_explains_every_option(capsys) -> None:
    for parser in (bench_serve.build_parser(), bench_compare.build_parser()):
        for action in parser._actions:  # noqa: SLF001
            assert action.help, f"{parser.prog}: {action.option_strings} has no help"


def _exit_code(main, argv) -> int:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    return exited.value.code


def _run(config: str, rate: float, goodput: float) -> dict:
    from benchmarks.serve.metrics import RequestRecord, Slo, summarize

    records = [RequestRecord(0, 4, 2, send_s=0.0, end_s=0.2, chunk_times_s=[0.1, 0.2],
                             chunk_tokens=[1, 1], status="OK", finish_reason="length")]  # fmt: skip
    summary = summarize(records, 1.0, Slo(ttft_ms=150))
    summary["goodput"] = goodput
    return {"config": config, "request_rate": rate, "summary": summary,
            "requests": [r.to_dict() for r in records]}  # fmt: skip


def test_compare_ratio_is_best_goodput_over_best_goodput(tmp_path) -> None:
    from benchmarks.serve import report as serve_report
    from benchmarks.serve.metrics import Slo

    runs = [_run("1P1D", 1.0, 1.0), _run("1P1D", 2.0, 1.8), _run("colocated:2", 1.0, 0.9),
            _run("colocated:2", 2.0, 0.6), _run("2P2D", 1.0, 0.0)]  # fmt: skip
    specs = [ClusterSpec.parse(n) for n in ("1P1D", "colocated:2", "2P2D")]
    text, ratios = bench_compare.ratio_text(runs, specs)
    assert ratios["1P1D / colocated:2"] == pytest.approx(2.0)
    assert ratios["1P1D / 2P2D"] is None and "no goodput" in text
    table = serve_report.throughput_table(runs)
    assert "colocated:2" in table and "1.80" in table
    assert "TTFT" in serve_report.latency_table(runs)
    serve_report.plot(tmp_path / "p.png", runs, Slo(150, None))
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
