"""`pd-bench compare`: the same request-rate sweep on several cluster configurations, one after
the other on the same devices, and the goodput ratio at the SLO (the DistServe experiment).

    pd-bench compare --configs 1P1D,colocated:2 --model synthetic:llama3-8b --dtype bfloat16 \\
        --dataset jsonl --dataset-path benchmarks/data/sharegpt_smollm2_500.jsonl \\
        --request-rate 2,4,8 --slo-ttft-ms 250 --slo-tpot-ms 25 --json cmp.json --plot cmp.png

--configs: comma-separated NPMD (N prefill + M decode nodes) or colocated[:N] (N decode nodes
that prefill locally). Every other pd-serve flag (--model, --device, --policy, ...) goes to each
configuration's pd-serve. The dataset is sampled once (from the first configuration's model) and
sent unchanged to every configuration. The ratio printed is the best goodput of the first
configuration over the sweep divided by that of each other one.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import grpc

from benchmarks.serve import report as serve_report
from benchmarks.serve.bench_serve import (
    add_dataset_flags,
    add_run_flags,
    check_flags,
    place_outputs,
    prepare,
    report,
    run_sweep,
)
from benchmarks.serve.cluster import BenchCluster, ClusterSpec


def _configs(text: str) -> list[ClusterSpec]:
    try:
        specs = [ClusterSpec.parse(part) for part in text.split(",") if part.strip()]
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    if len(specs) < 2:
        raise argparse.ArgumentTypeError("give at least two configurations, e.g. 1P1D,colocated:2")
    if len({s.name for s in specs}) != len(specs):
        raise argparse.ArgumentTypeError("configurations must differ")
    return specs


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pd-bench compare", description=__doc__.split("\n\n")[0], allow_abbrev=False,
        epilog="Any other flag goes to every pd-serve it starts (see pd-serve --help).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("--configs", type=_configs, required=True, metavar="C1,C2[,...]",
                        help="cluster configurations, e.g. 1P1D,colocated:2 (the first is "
                        "compared with each other one)")  # fmt: skip
    add_dataset_flags(parser)
    add_run_flags(parser)
    return parser


def ratio_text(runs: list[dict], specs: list[ClusterSpec]) -> tuple[str, dict[str, float | None]]:
    first = serve_report.max_goodput(runs, specs[0].name)
    lines, ratios = [], {}
    for spec in specs[1:]:
        other = serve_report.max_goodput(runs, spec.name)
        ratio = first / other if other > 0 else None
        ratios[f"{specs[0].name} / {spec.name}"] = ratio
        shown = f"{ratio:.2f}x" if ratio is not None else "- (no goodput)"
        lines.append(f"goodput ratio {specs[0].name} / {spec.name}: {shown} "
                     f"(best over the sweep: {first:.2f} vs {other:.2f} req/s)")  # fmt: skip
    return "\n".join(lines), ratios


def _run_config(spec: ClusterSpec, extra: list[str], args: argparse.Namespace,
                prepared: list) -> tuple[list[dict], dict]:  # fmt: skip
    log = Path(args.cluster_log)
    log = log.with_name(f"{log.stem}-{spec.name.replace(':', '')}{log.suffix}")
    with BenchCluster(
        spec, extra, log, args.cluster_timeout_s, progress=not args.no_progress
    ) as cluster:
        if not prepared:
            prepared.extend(prepare(cluster.address, args))
        requests, options, _ = prepared
        runs = run_sweep(cluster.address, spec.name, requests, options, args)
    return runs, {**asdict(spec), "serve_argv": cluster.argv()[1:], "log": str(log)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    args.addr, args.prefill, args.decode = None, 0, 1  # check_flags' cluster checks
    check_flags(parser, args, extra)
    payload: dict[str, Any] = {"command": shlex.join(["pd-bench", "compare", *argv]),
                               "configs": []}  # fmt: skip
    place_outputs(args, "compare")
    runs: list[dict] = []
    prepared: list = []
    try:
        for spec in args.configs:
            config_runs, described = _run_config(spec, extra, args, prepared)
            runs += config_runs
            payload["configs"].append(described)
    except grpc.aio.AioRpcError as error:
        print(f"pd-bench compare: {error.code().name}: {error.details()}", file=sys.stderr)
        return 1
    except (RuntimeError, ValueError, OSError) as error:
        print(f"pd-bench compare: {error}", file=sys.stderr)
        return 1
    payload["dataset"] = prepared[2]
    text, payload["goodput_ratio"] = ratio_text(runs, args.configs)
    report(runs, args, payload)
    print(f"\n{text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
