"""pd-bench turn-ttft: a conversation's next turn against a fresh prompt of the same new length
(issue 38's GPU target: a turn that adds 512 tokens to an 8K conversation reaches its first
token in <= 1.3x the TTFT of a fresh 512-token prompt).

    pd-bench turn-ttft [--model synthetic:llama3-8b] [--dtype bfloat16] [--context 8192]
                       [--new-tokens 512] [--repeats 5] [--serve-arg=--flag ...]
    pd-bench turn-ttft --addr HOST:PORT [--decode-nodes HOST:PORT]   (a running router)

Starts `pd-serve` 1P1D with a cluster secret (a fresh one in a temporary file unless
--serve-arg gives one: received KV is reused only in a cluster with a secret), then, one
request at a time, per repeat (random token ids, seeded, never seen before):
  turn 1   a --context-token prompt, --answer-tokens out (fills both nodes' prefix caches)
  turn 2   turn 1 + its answer + --new-tokens new tokens: TTFT, and the KV bytes its hand-off
           moved and skipped (the decode node's counters around it)
  fresh    --new-tokens tokens nobody holds: TTFT
Prints the medians, their ratio (the target: <= --target-ratio) and the bytes. Torch-free.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import secrets
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.serve.cluster import BenchCluster, ClusterSpec, kv_counters
from pdserve.config import SecurityConfig
from router.client import GenerationClient, build_request

REQUEST_TIMEOUT_S = 600.0


@dataclass
class TurnSamples:
    turn_ms: list[float] = field(default_factory=list)
    fresh_ms: list[float] = field(default_factory=list)
    moved_bytes: list[int] = field(default_factory=list)
    skipped_bytes: list[int] = field(default_factory=list)


async def _send(
    client: GenerationClient, ids: list[int], max_tokens: int
) -> tuple[float, list[int]]:
    """TTFT (ms) and the output token ids of one greedy request."""
    request = build_request(prompt_token_ids=ids, max_tokens=max_tokens, temperature=0.0,
                            ignore_eos=True)  # fmt: skip
    sent_s, first_s = time.monotonic(), None
    out: list[int] = []
    async for chunk in client.stream(request, timeout_s=REQUEST_TIMEOUT_S):
        if chunk.token_ids and first_s is None:
            first_s = time.monotonic()
        out.extend(chunk.token_ids)
    if first_s is None:
        raise RuntimeError("the router returned no token")
    return (first_s - sent_s) * 1e3, out


async def measure(
    addr: str, args: argparse.Namespace, nodes: list[str], security: SecurityConfig
) -> TurnSamples:
    samples = TurnSamples()
    rng = random.Random(args.seed)
    async with GenerationClient(addr) as client:
        info = await client.model_info(timeout_s=60)
        if args.context + args.answer_tokens + args.new_tokens + 1 > info.max_model_len:
            raise SystemExit(f"pd-bench turn-ttft: the turn exceeds max_model_len "
                             f"{info.max_model_len}; pass --serve-arg=--max-model-len=N")  # fmt: skip
        eos = set(info.eos_token_ids)
        vocab = [t for t in range(min(info.vocab_size, 32000)) if t not in eos]

        def fresh(n: int) -> list[int]:
            return [rng.choice(vocab) for _ in range(n)]

        for i in range(args.warmup + args.repeats):
            context = fresh(args.context)
            _, answer = await _send(client, context, args.answer_tokens)
            before = await kv_counters(nodes, security) if nodes else None
            turn_ms, _ = await _send(client, context + answer + fresh(args.new_tokens), 2)
            after = await kv_counters(nodes, security) if nodes else None
            fresh_ms, _ = await _send(client, fresh(args.new_tokens), 2)
            if i < args.warmup:
                continue
            samples.turn_ms.append(turn_ms)
            samples.fresh_ms.append(fresh_ms)
            if before is not None and after is not None:
                samples.moved_bytes.append(after[0] - before[0])
                samples.skipped_bytes.append(after[1] - before[1])
    return samples


def report(samples: TurnSamples, args: argparse.Namespace) -> bool:
    turn, fresh = statistics.median(samples.turn_ms), statistics.median(samples.fresh_ms)
    ratio = turn / fresh
    print(f"{'':24} {'median':>9} {'min':>9} {'max':>9}   (ms, {args.repeats} repeats)")
    for name, values in ((f"turn ({args.context} + {args.new_tokens} new)", samples.turn_ms),
                         (f"fresh ({args.new_tokens} tokens)", samples.fresh_ms)):  # fmt: skip
        print(f"{name:24} {statistics.median(values):9.1f} {min(values):9.1f} {max(values):9.1f}")
    verdict = "meets" if ratio <= args.target_ratio else "misses"
    print(f"turn / fresh TTFT: {ratio:.2f} ({verdict} the target <= {args.target_ratio})")
    if samples.moved_bytes:
        moved = statistics.median(samples.moved_bytes) / (1 << 20)
        skipped = statistics.median(samples.skipped_bytes) / (1 << 20)
        print(f"turn 2's hand-off: {moved:.1f} MiB moved, {skipped:.1f} MiB skipped (median)")
    return ratio <= args.target_ratio


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pd-bench turn-ttft", description=__doc__.split("\n\n")[0]
    )
    add = parser.add_argument
    add("--model", default="synthetic:llama3-8b", help="model (default %(default)s)")
    add("--dtype", default="bfloat16", help="pd-serve --dtype (default %(default)s)")
    add("--device", default="auto", help="pd-serve --device (default %(default)s)")
    add("--context", type=int, default=8192, help="turn 1's prompt tokens (default 8192)")
    add("--answer-tokens", type=int, default=16, help="turn 1's output tokens (default 16)")
    add("--new-tokens", type=int, default=512, help="turn 2's new tokens (default 512)")
    add("--repeats", type=int, default=5, help="measured repeats (default 5)")
    add("--warmup", type=int, default=1, help="unmeasured repeats first (default 1)")
    add("--seed", type=int, default=0, help="seed of the random prompts (default 0)")
    add("--target-ratio", type=float, default=1.3, help="exit 1 above it (default 1.3)")
    add("--addr", help="a running router (skip starting pd-serve)")
    add("--decode-nodes", default=None, help="with --addr: decode nodes, for the KV bytes")
    add("--serve-arg", action="append", default=[], help="extra pd-serve flag (repeatable)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if min(args.context, args.new_tokens, args.answer_tokens, args.repeats) < 1:
        parser.error("--context, --new-tokens, --answer-tokens and --repeats must be >= 1")
    if args.addr:
        nodes = args.decode_nodes.split(",") if args.decode_nodes else []
        samples = asyncio.run(measure(args.addr, args, nodes, SecurityConfig()))
        return 0 if report(samples, args) else 1
    serve = ["--model", args.model, "--dtype", args.dtype, "--device", args.device,
             "--log-level", "warning", *args.serve_arg]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="pd-bench-turn-") as folder:
        if not any(flag.startswith("--cluster-secret-file") for flag in serve):
            secret = Path(folder) / "secret"
            secret.write_text(secrets.token_hex(32) + "\n")
            secret.chmod(0o600)
            serve += ["--cluster-secret-file", str(secret)]
        print(f"pd-bench turn-ttft: {' '.join(serve)}", flush=True)
        with BenchCluster(ClusterSpec.parse("1P1D"), serve) as cluster:
            nodes, security = cluster.decode_addresses(), cluster.security()
            samples = asyncio.run(measure(cluster.address, args, nodes, security))
    return 0 if report(samples, args) else 1


if __name__ == "__main__":
    sys.exit(main())
