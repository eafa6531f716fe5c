"""pd-bench: pdserve's benchmarks, each printing a table beside the ceiling it is measured
against.

    pd-bench serve [...]       requests at a rate to a router: TTFT, TPOT, ITL, goodput at an SLO
    pd-bench compare [...]     the same sweep on several cluster configurations, goodput ratio
    pd-bench dataset [...]     sample a serve dataset into a JSONL file (it travels to the GPU)
    pd-bench transfer [...]    one request's KV, prefill process -> decode process (ucx, tcp)
    pd-bench mac [...]         the KV hand-off's frame MACs (host, GPU digest) vs the copy rate
    pd-bench ttft [...]        time to first token, 1P1D against colocated (starts pd-serve)
    pd-bench turn-ttft [...]   a conversation's next turn against a fresh prompt (KV reuse)
    pd-bench attention [...]   paged attention kernels (GPU)
    pd-bench offline [...]     offline engine throughput
    pd-bench engine [...]      decode step, prefill rate, step floor vs roofline and GEMM
    pd-bench spec [...]        speculative decoding at batch 1: tokens/s with and without it
    pd-bench profile [...]     a decode step's host phases and GPU kernels (torch.profiler)
    pd-bench kv-offload [...]  the host KV tier's promotion and demotion vs the plain copy rate
    pd-bench router [...]      what the router adds against instant nodes: latency, CPU, rate
    pd-bench fp8-kv [...]      FP8 KV cache quality vs the model's KV dtype (agreement, KL)

`pd-bench COMMAND --help` lists each command's flags.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "transfer": "benchmarks.transfer.bench_transfer",
    "mac": "benchmarks.transfer.bench_mac",
    "ttft": "benchmarks.serve.bench_ttft",
    "turn-ttft": "benchmarks.serve.bench_turn_ttft",
    "attention": "benchmarks.kernels.bench_attention",
    "offline": "benchmarks.engine.bench_offline",
    "serve": "benchmarks.serve.bench_serve",
    "compare": "benchmarks.serve.bench_compare",
    "dataset": "benchmarks.serve.bench_dataset",
    "engine": "benchmarks.engine.bench_engine",
    "spec": "benchmarks.engine.bench_spec",
    "profile": "benchmarks.engine.profile_step",
    "kv-offload": "benchmarks.engine.bench_kv_offload",
    "router": "benchmarks.router.bench_router",
    "fp8-kv": "benchmarks.engine.bench_fp8_kv",
}
# These take main(argv); the others parse sys.argv themselves.
ARGV_COMMANDS = (
    "transfer", "mac", "ttft", "turn-ttft", "serve", "compare", "dataset", "engine", "profile",
    "kv-offload", "spec", "router", "fp8-kv",
)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__.strip())
        return 0
    if not argv or argv[0] not in COMMANDS:
        problem = f"unknown command {argv[0]!r}" if argv else "no command given"
        print(f"{__doc__.strip()}\n\npd-bench: {problem}; choose one of {', '.join(COMMANDS)}",
              file=sys.stderr)  # fmt: skip
        return 2
    command, rest = argv[0], argv[1:]
    module = importlib.import_module(COMMANDS[command])
    if command in ARGV_COMMANDS:
        return module.main(rest)
    sys.argv = [f"pd-bench {command}", *rest]  # these parse sys.argv themselves
    return module.main() or 0


if __name__ == "__main__":
    sys.exit(main())
