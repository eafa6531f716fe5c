"""pd-client: send one prompt to a pdserve router and stream the completion to stdout.

    pd-client "The capital of France is" --max-tokens 16 --temperature 0
    pd-client --chat --system "Be brief." "What is KV caching?" --json

A gRPC error prints "pd-client: STATUS: details" to stderr and exits 1. A router started with
--api-key-file needs a key: set PDSERVE_API_KEY.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import grpc

from pdserve import envs
from pdserve.config import DEFAULT_HOST, DEFAULT_ROUTER_PORT
from pdserve.sampling_defaults import default_help
from pdserve.sampling_params import int_field_range
from pdserve.v1 import generation_pb2
from router.client import GenerationClient, GenerationResult


def _int_within(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: an integer the flag's protobuf field can hold (the router checks what
    it means: a usage error here, not a traceback, for what could never be sent)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be between {low} and {high}, got {value}")
        return value

    parse.__name__ = "integer"  # argparse's "invalid integer value" wording
    return parse


def _field(name: str) -> Callable[[str], int]:
    """The argparse type of a SamplingParams integer field: what its protobuf type holds."""
    return _int_within(*int_field_range(generation_pb2.SamplingParams, name))


# (flag, type, help) of SamplingParams fields; unset flags take the served model's default
# (its generation config's, or its model card's), else SamplingParams'.
_SAMPLING_FLAGS = (
    ("--max-tokens", _field("max_tokens"), "tokens to generate at most"),
    ("--temperature", float, "0: greedy"),
    ("--top-p", float, "nucleus sampling mass, in (0, 1]"),
    ("--top-k", _field("top_k"), "0 or -1: disabled"),
    ("--min-p", float, "in [0, 1]"),
    ("--repetition-penalty", float, "> 0; 1 disables"),
    ("--presence-penalty", float, "in [-2, 2]"),
    ("--frequency-penalty", float, "in [-2, 2]"),
    ("--seed", _field("seed"), "same seed, same tokens; unset: a random one per request"),
    ("--min-tokens", _field("min_tokens"), "no stop before this many tokens"),
    ("--logprobs", _field("logprobs"), "0: the sampled token's; n: plus the top n"),
)
_SAMPLING_FIELDS = (
    *(flag[2:].replace("-", "_") for flag, _, _ in _SAMPLING_FLAGS),
    "stop",
    "stop_token_ids",
    "ignore_eos",
)


def build_client_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pd-client", description=__doc__.split("\n\n")[0])
    parser.add_argument("prompt")
    address = f"{DEFAULT_HOST}:{DEFAULT_ROUTER_PORT}"
    parser.add_argument("--addr", default=address, help=f"router (default: {address})")
    parser.add_argument(
        "--chat", action="store_true", help="send the prompt as a user message (chat template)"
    )
    parser.add_argument(
        "--system",
        action="append",
        default=[],
        help="with --chat: a system message first (repeatable; default: none)",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object at the end instead of streaming text",
    )
    parser.add_argument(
        "--request-id", default="", help="(default: the router assigns a unique one)"
    )
    parser.add_argument(
        "--timeout-s", type=float, default=None, help="deadline of the call (default: none)"
    )
    sampling = parser.add_argument_group(
        "sampling (unset: the served model's default, from its generation config or model "
        "card, else SamplingParams')"
    )
    for flag, type_, help_text in _SAMPLING_FLAGS:
        default = default_help(flag[2:].replace("-", "_"))
        sampling.add_argument(flag, type=type_, default=None, help=f"{help_text} ({default})")
    sampling.add_argument(
        "--stop", action="append", default=None, help="stop string (repeatable; default: none)"
    )
    sampling.add_argument(
        "--stop-token-id",
        dest="stop_token_ids",
        type=_field("stop_token_ids"),
        action="append",
        default=None,
        help="stop token id (repeatable; default: none)",
    )
    sampling.add_argument(
        "--ignore-eos", action="store_true", default=None, help="(default: stop at EOS)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:  # the reader left (`pd-client ... | head`): stop, no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # exit's flush too
        return 141  # what a shell reports for a process ended by SIGPIPE


def _main(argv: list[str] | None) -> int:
    parser = build_client_parser()
    args = parser.parse_args(argv)
    if args.system and not args.chat:
        parser.error("--system needs --chat")
    try:
        result = asyncio.run(_generate(args))
    except grpc.aio.AioRpcError as error:
        print(f"pd-client: {error.code().name}: {error.details()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    if args.json:
        payload = result.to_dict()
        if args.logprobs is not None:
            payload["logprobs"] = [_logprob_dict(lp) for lp in result.logprobs]
        print(json.dumps(payload, ensure_ascii=False))
    else:
        print(flush=True)
    return 0


async def _generate(args: argparse.Namespace) -> GenerationResult:
    inputs: dict[str, Any] = {"prompt": args.prompt}
    if args.chat:
        messages = [{"role": "system", "content": text} for text in args.system]
        inputs = {"messages": [*messages, {"role": "user", "content": args.prompt}]}
    sampling = {name: getattr(args, name) for name in _SAMPLING_FIELDS}
    result = GenerationResult()
    async with GenerationClient(args.addr, envs.api_key()) as client:
        chunks = client.generate(
            **inputs, request_id=args.request_id, timeout_s=args.timeout_s, **sampling
        )
        async for chunk in chunks:
            result.add(chunk)
            if not args.json and chunk.text:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
    return result


def _logprob_dict(logprob: generation_pb2.TokenLogprob) -> dict[str, Any]:
    return {
        "token_id": logprob.token_id,
        "logprob": logprob.logprob,
        "rank": logprob.rank,
        "top": [{"token_id": t.token_id, "logprob": t.logprob} for t in logprob.top],
    }


if __name__ == "__main__":
    sys.exit(main())
