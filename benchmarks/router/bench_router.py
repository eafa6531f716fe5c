"""pd-bench router: what the router adds in front of nodes that answer at once.

    pd-bench router [--mode pd colocated] [--api grpc http] [--idle-requests 600]
                    [--rates 250 500 1000 1500 2000] [--duration-s 4] [--prompt-tokens 16]
                    [--output-tokens 16] [--chunk-tokens 16] [--router-arg=--flag ...]
                    [--baseline DIR] [--variant-arg=--flag ...] [--repeat N]
                    [--router-profile PATH]

Starts instant nodes (benchmarks/router/fake_nodes.py: the real node gRPC protocol, every
answer at once, the P -> D hand-off a loopback datagram) and a pd-router on them, each in its
own process, and measures from this process:

- idle latency: one request at a time, in rounds that alternate the three paths: `direct` (this
  process makes the router's node calls itself: the nodes' own time as a client sees it, their
  gRPC stacks and the hand-off included), `grpc` and `http` through the router. Added by the
  router = router path - direct, percentile by percentile (p50, p99), TTFT and whole request.
- the router's CPU per request (/proc/PID/stat over the idle rounds and each load step).
- open loop: a request every 1/rate s for duration_s at each rate; the router sustains a rate
  when it completes >= 95% of it, with no error and p99 <= --slo-p99-ms. Saturation: the
  highest rate sustained below the first one that is not.

Everything shares this machine's cores (router, nodes and this client): the load average is
printed with the numbers. `--baseline DIR` runs a router from another source tree (e.g.
`git archive main | tar -x -C DIR`) in turn with this checkout's, `--repeat` times: before and
after under the same load; `--variant-arg` runs this checkout's router a second time with
extra flags, in the same turns (e.g. `--variant-arg=--event-loop=uvloop`). `--router-profile PATH` runs the router under cProfile
(profiled_router.py) and prints where its event loop's CPU went. Torch-free.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pstats
import sys
import time
from dataclasses import dataclass

import aiohttp

from benchmarks.router.load import (
    DirectTarget,
    GrpcTarget,
    HttpTarget,
    LoadResult,
    Target,
    one_at_a_time,
    open_loop,
)
from benchmarks.router.procs import InstantCluster

ROUNDS = 6  # idle requests are split in rounds alternating the paths (drift hits all alike)


@dataclass
class Idle:
    results: dict[str, LoadResult]
    router_cpu_ms: dict[str, float]  # per request, by path


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))] if ordered else 0.0


def load_avg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


async def make_targets(cluster: InstantCluster, args: argparse.Namespace) -> dict[str, Target]:
    targets: dict[str, Target] = {
        "direct": DirectTarget(
            cluster.decode_address, cluster.prefill_address, args.prompt_tokens,
            args.output_tokens,
        ),
    }  # fmt: skip
    if "grpc" in args.api:
        targets["grpc"] = GrpcTarget(cluster.address, args.prompt_tokens, args.output_tokens)
    if "http" in args.api:
        http = HttpTarget(cluster.url, args.prompt_tokens, args.output_tokens)
        async with aiohttp.ClientSession() as session, session.get(f"{cluster.url}/v1/models") as r:
            http.model = (await r.json())["data"][0]["id"]
        targets["http"] = http
    return targets


async def idle_latency(
    cluster: InstantCluster, targets: dict[str, Target], num_requests: int
) -> Idle:
    assert cluster.router is not None
    results = {name: LoadResult() for name in targets}
    cpu_s = dict.fromkeys(targets, 0.0)
    per_round = max(1, num_requests // ROUNDS)
    index = 10_000_000
    for _ in range(ROUNDS):
        for name, target in targets.items():
            before = cluster.router.cpu_s()
            result = await one_at_a_time(target, per_round, index)
            cpu_s[name] += cluster.router.cpu_s() - before
            index += per_round
            total = results[name]
            total.samples += result.samples
            total.num_sent += result.num_sent
            total.num_errors += result.num_errors
            total.errors += result.errors
    cpu_ms = {name: 1e3 * cpu_s[name] / max(1, results[name].num_sent) for name in targets}
    return Idle(results, cpu_ms)


def print_idle(idle: Idle) -> None:
    head = (
        f"{'path':<14}| {'TTFT p50':>8} | {'TTFT p99':>8} | {'total p50':>9} | {'total p99':>9} | "
        f"{'errors':>6} | router CPU/req"
    )
    print(head + "\n" + "-" * len(head))
    for name, result in idle.results.items():
        ttft = [s.ttft_s * 1e3 for s in result.samples]
        total = [s.total_s * 1e3 for s in result.samples]
        cpu = "-" if name == "direct" else f"{idle.router_cpu_ms[name]:.3f} ms"
        print(
            f"{name:<14}| {pct(ttft, 50):8.3f} | {pct(ttft, 99):8.3f} | {pct(total, 50):9.3f} | "
            f"{pct(total, 99):9.3f} | {result.num_errors:6d} | {cpu}"
        )
    direct = idle.results["direct"].samples
    for name, result in idle.results.items():
        if name == "direct":
            continue
        parts = []
        for label, key in (("TTFT", "ttft_s"), ("total", "total_s")):
            via = [getattr(s, key) * 1e3 for s in result.samples]
            base = [getattr(s, key) * 1e3 for s in direct]
            parts.append(
                f"{label} p50 {pct(via, 50) - pct(base, 50):+.3f} / "
                f"p99 {pct(via, 99) - pct(base, 99):+.3f}"
            )
        print(f"added by the router ({name} - direct), ms: {'; '.join(parts)}")
    for name, result in idle.results.items():
        for error in result.errors:
            print(f"  {name} error: {error}")


async def load_ladder(
    cluster: InstantCluster, name: str, target: Target, args: argparse.Namespace
) -> None:
    assert cluster.router is not None
    head = (
        f"{name:>5} offered/s | {'done/s':>7} | {'errors':>6} | {'p50 ms':>7} | {'p99 ms':>7} | "
        f"{'router CPU':>10} | {'CPU/req':>8} | sustained"
    )
    print(head + "\n" + "-" * len(head))
    index = 20_000_000
    saturation = 0.0
    failed = False
    for rate in args.rates:
        before_cpu, before_s = cluster.router.cpu_s(), time.perf_counter()
        result = await open_loop(target, rate, args.duration_s, index)
        cpu_s, wall_s = cluster.router.cpu_s() - before_cpu, time.perf_counter() - before_s
        index += result.num_sent
        total = [s.total_s * 1e3 for s in result.samples]
        ok = (
            result.num_errors == 0 and result.num_dropped == 0
            and len(result.samples) >= 0.95 * result.num_sent
            and result.rate >= 0.95 * rate and pct(total, 99) <= args.slo_p99_ms
        )  # fmt: skip
        if ok and not failed:
            saturation = rate
        failed = failed or not ok
        print(
            f"{rate:15.0f} | {result.rate:7.0f} | {result.num_errors + result.num_dropped:6d} | "
            f"{pct(total, 50):7.2f} | {pct(total, 99):7.2f} | {100 * cpu_s / wall_s:9.0f}% | "
            f"{1e3 * cpu_s / max(1, result.num_sent):6.3f}ms | {'yes' if ok else 'no'}"
        )
        for error in result.errors:
            print(f"  error: {error}")
        await asyncio.sleep(0.5)  # the in-flight tail of a saturated step drains
    print(f"{name}: sustained up to {saturation:.0f} requests/s (load average {load_avg()})")


def node_times(cluster: InstantCluster) -> str:
    """The nodes' own handler times (printed by them when stopped)."""
    parts = []
    for line in cluster.node_lines():
        if line.startswith("fake-node times "):
            times = json.loads(line.removeprefix("fake-node times "))
            handler_ms = [t * 1e3 for t in times["handler_s"]]
            parts.append(
                f"p50 {pct(handler_ms, 50):.3f} / p99 {pct(handler_ms, 99):.3f} ms over "
                f"{len(handler_ms)} calls, {times['handoff_timeouts']} hand-off timeouts"
            )
    return "; ".join(parts)


async def run_mode(mode: str, args: argparse.Namespace, variant: Variant) -> None:
    label, router_cmd, router_args = variant
    disaggregated = mode == "pd"
    what = "1 instant prefill + 1 instant decode node" if disaggregated else "1 instant decode node"
    print(f"\n== mode {mode}: {what}; router: {label}, args {router_args or '(defaults)'}")
    print(f"load average at start: {load_avg()}")
    profile = f"{args.router_profile}.{mode}" if args.router_profile else None
    with InstantCluster(
        disaggregated, args.chunk_tokens, router_args, args.uvloop_nodes, profile, router_cmd
    ) as c:
        targets = await make_targets(c, args)
        try:
            for target in targets.values():
                await one_at_a_time(target, args.warmup, 0)
            idle = await idle_latency(c, targets, args.idle_requests)
            print(f"idle latency, ms ({args.idle_requests} requests a path, {ROUNDS} "
                  f"alternating rounds; load average {load_avg()}):")  # fmt: skip
            print_idle(idle)
            for name in args.api:
                if args.rates:
                    print(f"\nopen loop ({args.duration_s:g} s a step), {name}:")
                    await load_ladder(c, name, targets[name], args)
        finally:
            for target in targets.values():
                await target.close()
    print(f"node handler times (waits excluded): {node_times(c)}")
    if profile:
        print(f"\nrouter profile ({profile}), top functions by own time:")
        pstats.Stats(profile, stream=sys.stdout).sort_stats("tottime").print_stats(25)


# (label, the router's command (None: this checkout's), its flags)
Variant = tuple[str, list[str] | None, list[str]]


def variants(args: argparse.Namespace) -> list[Variant]:
    """The routers compared: --baseline's, this checkout's, this checkout's with --variant-arg."""
    result: list[Variant] = [("this checkout", None, args.router_arg)]
    if args.baseline:
        env = ["env", f"PYTHONPATH={os.path.abspath(args.baseline)}"]
        command = [*env, sys.executable, "-m", "router.cli"]
        result.insert(0, (f"baseline {args.baseline}", command, args.router_arg))
    if args.variant_arg:
        result.append(("this checkout", None, [*args.router_arg, *args.variant_arg]))
    return result


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pd-bench router", description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", nargs="+", default=["pd", "colocated"], choices=["pd", "colocated"])
    p.add_argument("--api", nargs="+", default=["grpc", "http"], choices=["grpc", "http"])
    p.add_argument("--idle-requests", type=int, default=600, help="per path, one at a time")
    p.add_argument("--rates", type=float, nargs="*", default=[250, 500, 1000, 1500, 2000],
                   help="open-loop request rates (none: skip)")  # fmt: skip
    p.add_argument("--duration-s", type=float, default=4.0, help="each open-loop step")
    p.add_argument("--slo-p99-ms", type=float, default=50.0, help="p99 a sustained rate keeps")
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--chunk-tokens", type=int, default=16, help="tokens per decode node message")
    p.add_argument("--uvloop-nodes", action="store_true", help="the fake nodes on uvloop")
    p.add_argument("--warmup", type=int, default=200, help="unmeasured requests a path")
    p.add_argument("--repeat", type=int, default=1, help="each mode this many times")
    p.add_argument("--baseline", metavar="DIR",
                   help="also a router from this source tree (e.g. git archive of main), "
                   "alternating with this checkout's")  # fmt: skip
    p.add_argument("--variant-arg", action="append", default=[],
                   help="also this checkout's router with this extra flag (repeatable), "
                   "alternating with the others, e.g. --variant-arg=--event-loop=uvloop")  # fmt: skip
    p.add_argument("--router-profile", metavar="PATH",
                   help="run the router under cProfile; stats to PATH.MODE, top lines printed")  # fmt: skip
    p.add_argument("--router-arg", action="append", default=[],
                   help="extra pd-router flag (repeatable), e.g. --router-arg=--log-level=warning")  # fmt: skip
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if min(args.prompt_tokens, args.output_tokens, args.chunk_tokens, args.idle_requests,
           args.repeat) < 1 or args.warmup < 0:  # fmt: skip
        parser.error("--prompt-tokens, --output-tokens, --chunk-tokens, --idle-requests, "
                     "--repeat >= 1; --warmup >= 0")  # fmt: skip
    print(
        f"pd-bench router: {args.prompt_tokens} prompt tokens, {args.output_tokens} output "
        f"tokens in chunks of {args.chunk_tokens}; {os.cpu_count()} CPUs; router, nodes and "
        "client each in its own process"
    )
    for mode in args.mode:
        for _ in range(args.repeat):
            for variant in variants(args):  # before / after in turn (a loaded machine drifts)
                asyncio.run(run_mode(mode, args, variant))
    return 0


if __name__ == "__main__":
    sys.exit(main())
