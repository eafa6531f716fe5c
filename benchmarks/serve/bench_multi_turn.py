"""`pd-bench serve --multi-turn`: ShareGPT conversations replayed turn by turn.

    pd-bench serve --prefill 1 --decode 1 --model smollm2-135m --device cpu \\
        --dataset sharegpt --multi-turn --num-prompts 8 --min-turns 3 --max-turns 4 \\
        --max-output-tokens 32 --max-concurrency 1 --cluster-secret-file SECRET

Each conversation (--num-prompts of them, started at --request-rate) sends its turns one after
the other, each prompt the whole chat so far (the model's own answers included, as a chat
client sends it), --think-time-s apart. Reported per turn index: TTFT, and, with one request
in flight at a time (--max-concurrency 1), the KV bytes each turn's hand-off moved and skipped
(the decode nodes' counters: NodeStats; a started cluster's own, or --decode-nodes with
--addr). Received KV is reused only in a cluster with a secret (--cluster-secret-file).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import uuid
from dataclasses import asdict
from typing import Any

from benchmarks.serve import report as serve_report
from benchmarks.serve.conversations import Conversation, sharegpt_conversations
from benchmarks.serve.load import arrival_offsets_s, rate_label
from benchmarks.serve.metrics import Slo, summarize
from benchmarks.serve.multi_turn import KVCounters, TurnOptions, run_conversations
from benchmarks.serve.runner import SendOptions
from benchmarks.serve.turn_report import turn_summary, turn_table
from pdserve.tokenizer import Tokenizer

DEFAULT_MAX_LEN = 4096


def add_multi_turn_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("multi-turn (--dataset sharegpt --multi-turn)")
    group.add_argument("--multi-turn", action="store_true",
                       help="replay each conversation turn by turn, its prompt the whole chat "
                       "so far; --num-prompts counts conversations")  # fmt: skip
    group.add_argument("--min-turns", type=int, default=3,
                       help="conversations with at least this many exchanges (default 3)")  # fmt: skip
    group.add_argument("--max-turns", type=int, default=5,
                       help="turns sent per conversation at most (default 5)")  # fmt: skip
    group.add_argument("--think-time-s", type=float, default=0.0,
                       help="between an answer and the next turn (default 0)")  # fmt: skip
    group.add_argument("--multi-turn-max-len", type=int, default=None, metavar="N",
                       help="a conversation ends before a turn whose prompt + max_tokens "
                       f"exceeds N (default: min({DEFAULT_MAX_LEN}, the context))")  # fmt: skip
    group.add_argument("--decode-nodes", default=None, metavar="HOST:PORT[,...]",
                       help="with --addr: the decode nodes whose counters give each turn's KV "
                       "bytes (a started cluster's are known)")  # fmt: skip


def check_multi_turn_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if not args.multi_turn:
        return
    if args.dataset != "sharegpt":
        parser.error("--multi-turn replays ShareGPT conversations: use --dataset sharegpt")
    if not 1 <= args.min_turns <= args.max_turns:
        parser.error("need 1 <= --min-turns <= --max-turns")
    if args.think_time_s < 0:
        parser.error("--think-time-s must be >= 0")


def load_conversations(
    args: argparse.Namespace, spec: Any, tokenizer: Tokenizer | None
) -> list[Conversation]:
    conversations = sharegpt_conversations(spec, tokenizer, args.min_turns, args.max_turns)
    if not conversations:
        raise ValueError(f"no ShareGPT conversation of >= {args.min_turns} usable turns")
    return conversations


def run_multi_turn(
    addr: str, config: str, conversations: list[Conversation], tokenizer: Tokenizer,
    options: SendOptions, max_model_len: int, counters: KVCounters | None,
    args: argparse.Namespace,
) -> list[dict]:  # fmt: skip
    """One run per request rate (conversation arrivals): its summary and per-turn figures."""
    from tqdm import tqdm

    max_len = args.multi_turn_max_len or min(DEFAULT_MAX_LEN, max_model_len)
    turns = TurnOptions(args.think_time_s, max_len)
    runs, slo, tag = [], Slo(args.slo_ttft_ms, args.slo_tpot_ms), uuid.uuid4().hex[:8]
    total = sum(len(c.turns) for c in conversations)
    for rate in args.request_rate:
        offsets = arrival_offsets_s(len(conversations), rate, args.burstiness, args.seed)
        bar = tqdm(total=total, desc=f"{config} @ {rate_label(rate)} conv/s",
                   disable=args.no_progress, file=sys.stderr)  # fmt: skip
        with bar:
            records, duration_s = asyncio.run(run_conversations(
                addr, conversations, tokenizer, offsets, options, turns,
                args.max_concurrency, counters, bar, run_name=f"chat-{tag}-{rate_label(rate)}",
            ))  # fmt: skip
        runs.append({"config": config, "request_rate": rate,
                     "summary": summarize(records, duration_s, slo),  # type: ignore[arg-type]
                     "turns": turn_summary(records),
                     "requests": [r.to_dict() for r in records]})  # fmt: skip
    return runs


def print_turns(runs: list[dict], exact: bool) -> None:
    for run in runs:
        print(f"\nper turn ({run['config']} @ {rate_label(run['request_rate'])} conv/s; "
              "TTFT in ms; KV per request from the decode nodes' counters)")  # fmt: skip
        print(turn_table(run["config"], run["turns"]))
    if not exact:
        print("(KV bytes per turn need one request at a time: --max-concurrency 1, and the "
              "decode nodes' addresses: a started cluster, or --decode-nodes)")  # fmt: skip


def dataset_description(conversations: list[Conversation], spec: Any, args: Any) -> dict:
    return {**asdict(spec), "multi_turn": True, "min_turns": args.min_turns,
            "max_turns": args.max_turns, "think_time_s": args.think_time_s,
            "num_conversations": len(conversations),
            "num_turns": sum(len(c.turns) for c in conversations)}  # fmt: skip


def print_run_tables(runs: list[dict], slo: Slo) -> None:
    print(f"\nSLO: {serve_report.slo_text(slo)}")
    print(serve_report.throughput_table(runs))
    print()
    print(serve_report.latency_table(runs))
