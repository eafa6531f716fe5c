"""pd-bench ttft: time to first token through 1P1D against colocated serving, same devices.

    pd-bench ttft [--model synthetic:llama3-8b] [--prompt-tokens 2048 8192] [--requests 5]
                  [--transport ucx] [--device auto] [--dtype auto] [--serve-arg=--flag ...]
    pd-bench ttft --pd-addr HOST:PORT --colocated-addr HOST:PORT    (routers already running)
    pd-bench ttft --breakdown ...    also where each TTFT went (router and node milestones)

Starts `pd-serve --prefill 0` (colocated), measures, stops it; then `pd-serve` 1P1D on the same
devices, measures, stops it. Each measurement sends idle single requests (one at a time,
distinct random prompts so no prefix is cached, greedy, 2 output tokens, a warm-up request
per length first) and records the time to the first token and to the second (which in 1P1D
also waits for the KV hand-off and the decode node's first step). Prints TTFT median / p90 for
both, their ratio, the milestones of each length's last 1P1D request (node marks and client
token arrivals), and the per-layer timeline of the last 1P1D request (computed and sent on the
prefill node, landed on the decode node; ms after the request was sent, one host clock). With
both nodes on one GPU the prefill holds every layer but the last back until the one before the
last is written (cache_transfer/README.md), so those layers all show the time it saw that one.
With --breakdown every measured request is traced (the router's milestones come back in its
trailing metadata; the nodes' marks of a 1P1D request from GetStats right after it) and a table
per length splits the median TTFT into router, hop and node rows (ttft_breakdown.py); without
it nothing is traced.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from benchmarks.serve.cluster import BenchCluster, ClusterSpec
from benchmarks.serve.ttft_breakdown import RequestTimes, node_marks, table
from pdserve.v1 import node_pb2
from router.client import GenerationClient, build_request

REQUEST_TIMEOUT_S = 600.0


@dataclass
class Samples:
    ttft_ms: list[float] = field(default_factory=list)
    second_ms: list[float] = field(default_factory=list)
    last_sent_s: float = 0.0  # monotonic time the last request was sent
    last_token_s: list[float] = field(default_factory=list)  # its tokens' arrival times
    milestones: list[str] = field(default_factory=list)  # its path through the nodes
    traced: list[RequestTimes] = field(default_factory=list)  # --breakdown: every measured one

    def median(self, which: str = "ttft_ms") -> float:
        return statistics.median(getattr(self, which))

    def p90(self, which: str = "ttft_ms") -> float:
        values = sorted(getattr(self, which))
        return values[min(len(values) - 1, round(0.9 * (len(values) - 1)))]


# The prefill and decode nodes' last LayerTimeline (1P1D), fetched after each traced request.
NodeTimelines = Callable[[], tuple[node_pb2.LayerTimeline, node_pb2.LayerTimeline]]


async def measure(
    addr: str,
    prompt_tokens: int,
    requests: int,
    warmup: int,
    seed: int,
    breakdown: bool = False,
    timelines: NodeTimelines | None = None,
) -> Samples:
    """Idle single requests at one prompt length: TTFT and time to the second token, in ms;
    with `breakdown`, each measured request's milestones (and its nodes', via `timelines`)."""
    samples = Samples()
    rng = random.Random(seed * 1_000_003 + prompt_tokens)
    async with GenerationClient(addr) as client:
        info = await client.model_info(timeout_s=60)
        if prompt_tokens + 2 > info.max_model_len:
            raise SystemExit(
                f"pd-bench ttft: {prompt_tokens} prompt tokens exceed the model's max_model_len "
                f"{info.max_model_len}; pass --serve-arg=--max-model-len=N"
            )
        eos = set(info.eos_token_ids)
        vocab = [t for t in range(min(info.vocab_size, 32000)) if t not in eos]
        for i in range(warmup + requests):
            ids = [rng.choice(vocab) for _ in range(prompt_tokens)]
            request_id = f"ttft{prompt_tokens}-{i}"
            request = build_request(prompt_token_ids=ids, max_tokens=2, temperature=0.0,
                                    ignore_eos=True, request_id=request_id)  # fmt: skip
            times: list[float] = []
            trace: dict[str, float] | None = {} if breakdown and i >= warmup else None
            sent_s = time.monotonic()
            async for chunk in client.stream(request, REQUEST_TIMEOUT_S, trace):
                times.extend(time.monotonic() for _ in chunk.token_ids)
            if len(times) < 2:
                raise RuntimeError(f"the router returned {len(times)} tokens, expected 2")
            if i >= warmup:
                samples.ttft_ms.append((times[0] - sent_s) * 1e3)
                samples.second_ms.append((times[1] - sent_s) * 1e3)
                samples.last_sent_s = sent_s
                samples.last_token_s = times
            if trace is not None:
                traced = RequestTimes(sent_s, times[0], trace)
                if timelines is not None:
                    prefill, decode = await asyncio.to_thread(timelines)
                    traced.prefill = node_marks(prefill, request_id)
                    traced.decode = node_marks(decode, request_id)
                samples.traced.append(traced)
    return samples


def run_all(
    addr: str, args: argparse.Namespace, cluster: BenchCluster | None = None
) -> dict[int, Samples]:
    """Samples per prompt length; with the 1P1D `cluster`, each length's last request's
    milestones too."""
    results = {}
    timelines = None
    if cluster is not None:

        def timelines() -> tuple[node_pb2.LayerTimeline, node_pb2.LayerTimeline]:
            return (
                cluster.node_stats("prefill-0").last_transfer,
                cluster.node_stats("decode-0").last_transfer,
            )

    for n in args.prompt_tokens:
        results[n] = asyncio.run(
            measure(addr, n, args.requests, args.warmup, args.seed, args.breakdown, timelines)
        )
        if cluster is not None:
            results[n].milestones = milestone_rows(cluster, results[n])
    return results


def milestone_rows(cluster: BenchCluster, samples: Samples) -> list[str]:
    """Where the last request's time went: every milestone the nodes recorded (node marks,
    the last layer computed / landed) and the client's token arrivals, in time order, ms after
    the request was sent (one host clock)."""
    prefill = cluster.node_stats("prefill-0").last_transfer
    decode = cluster.node_stats("decode-0").last_transfer
    events = [(t, f"prefill {name}") for name, t in prefill.marks_s.items()]
    events += [(t, f"decode {name}") for name, t in decode.marks_s.items()]
    if prefill.computed_s:
        events.append((prefill.computed_s[0], "prefill layer 0 computed"))
        events.append((prefill.computed_s[-1], "prefill last layer computed"))
    if decode.landed_s:
        events.append((decode.landed_s[-1], "decode last layer landed"))
    events += [(t, f"client token {i}") for i, t in enumerate(samples.last_token_s)]
    return [
        f"{(t - samples.last_sent_s) * 1e3:9.2f}  {what}" for t, what in sorted(events) if t > 0
    ]


def timeline_rows(cluster: BenchCluster, sent_s: float) -> list[str]:
    """The last 1P1D request's per-layer timeline, ms after it was sent."""
    prefill = cluster.node_stats("prefill-0").last_transfer
    decode = cluster.node_stats("decode-0").last_transfer
    if not prefill.computed_s or not decode.landed_s:
        return ["(no per-layer timeline: the nodes report none)"]

    def ms(t: float) -> str:
        return f"{(t - sent_s) * 1e3:9.2f}" if t > 0 else "        -"

    rows = [
        f"{'layer':>5} {'computed':>9} {'sent':>9} {'landed':>9}   ms after the request was sent"
    ]
    for i, (c, s, landed) in enumerate(zip(prefill.computed_s, prefill.sent_s, decode.landed_s)):
        rows.append(f"{i:5d} {ms(c)} {ms(s)} {ms(landed)}")
    last_gap = (decode.landed_s[-1] - prefill.computed_s[-1]) * 1e3
    rows.append(f"last layer landed {last_gap:.2f} ms after it was computed")
    return rows


def print_table(colocated: dict[int, Samples], pd: dict[int, Samples]) -> None:
    head = (
        f"{'prompt':>7} | {'colocated TTFT med / p90':>25} | {'1P1D TTFT med / p90':>21} | "
        f"{'ratio':>5} | {'2nd token coloc / 1P1D':>23}"
    )
    print(head)
    print("-" * len(head))
    for n in pd:
        c, p = colocated[n], pd[n]
        print(
            f"{n:7d} | {c.median():11.1f} / {c.p90():8.1f} ms | {p.median():8.1f} / "
            f"{p.p90():7.1f} ms | {p.median() / c.median():5.2f} | "
            f"{c.median('second_ms'):9.1f} / {p.median('second_ms'):7.1f} ms"
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pd-bench ttft", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model",
        default="synthetic:llama3-8b",
        help="model both clusters serve (a synthetic: shape needs no weights)",
    )
    parser.add_argument("--dtype", default="auto", help="weights and KV dtype (pd-serve --dtype)")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda (pd-serve --device)")
    parser.add_argument(
        "--transport",
        default="auto",
        choices=["auto", "ucx", "tcp"],
        help="the 1P1D cluster's KV transport",
    )
    parser.add_argument(
        "--prompt-tokens",
        type=int,
        nargs="+",
        default=[2048, 8192],
        help="prompt lengths to measure (random token ids)",
    )
    parser.add_argument("--requests", type=int, default=5, help="measured per prompt length")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured requests per length")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="trace every measured request: where its TTFT went (router, hops, nodes)",
    )
    parser.add_argument("--pd-addr", help="a running 1P1D router (skip starting one)")
    parser.add_argument("--colocated-addr", help="a running colocated router")
    parser.add_argument(
        "--serve-arg", action="append", default=[], help="extra pd-serve flag (repeatable)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.requests < 1 or args.warmup < 0 or min(args.prompt_tokens) < 1:
        parser.error("--requests and --prompt-tokens must be >= 1, --warmup >= 0")
    serve = ["--model", args.model, "--dtype", args.dtype, "--device", args.device]
    serve += ["--kv-transport", args.transport, "--log-level", "warning", *args.serve_arg]
    print(
        f"pd-bench ttft: {args.model} ({args.dtype}, device {args.device}, kv {args.transport}), "
        f"{args.requests} idle single requests per length after {args.warmup} warm-up",
        flush=True,
    )
    if args.colocated_addr:
        colocated = run_all(args.colocated_addr, args)
    else:
        with BenchCluster(ClusterSpec.parse("colocated"), serve) as cluster:
            colocated = run_all(cluster.address, args)
    timeline = ["(timeline: only when pd-bench starts the 1P1D cluster)"]
    if args.pd_addr:
        pd = run_all(args.pd_addr, args)
    else:
        with BenchCluster(ClusterSpec.parse("1P1D"), serve) as cluster:
            pd = run_all(cluster.address, args, cluster)
            timeline = timeline_rows(cluster, pd[args.prompt_tokens[-1]].last_sent_s)
    print_table(colocated, pd)
    for n, samples in pd.items():
        if samples.milestones:
            print(f"\nmilestones of the last 1P1D request ({n} tokens), ms after it was sent:")
            print("\n".join(samples.milestones))
    print(f"\nper-layer timeline of the last 1P1D request ({args.prompt_tokens[-1]} tokens):")
    print("\n".join(timeline))
    if args.breakdown:
        for n in pd:
            print(f"\nwhere the TTFT went, {n} prompt tokens ({args.requests} requests each):")
            print("\n".join(table(colocated[n].traced, pd[n].traced)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
