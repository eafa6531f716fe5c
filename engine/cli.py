"""`pd-generate`: offline generation with the engine (no servers), for a quick local check.

pd-generate "Write a haiku about GPUs" --max-tokens 64
pd-generate --chat "What is the capital of France?"
pd-generate --tensor-parallel-size 3 "Hello"   (smollm2-135m's 9 heads over 3 ranks)
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict

from pdserve.cli import ArgumentParser, add_config_flags, config_from_args
from pdserve.config import DEFAULT_MODEL, ParallelConfig
from pdserve.logs import configure_logging

DEFAULT_PROMPT = "What is the capital of France?"


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="pd-generate", description=__doc__.split("\n")[0])
    p.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT)
    p.add_argument("--chat", action="store_true", help="render the prompt with the chat template")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    add_config_flags(p, p.add_argument_group("tensor parallelism"), ParallelConfig, ())
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # INFO: a cold start's conversion and loading progress (a bar instead on a terminal)
    configure_logging("info", "generate")
    from engine import LLM, InvalidRequestError, SamplingParams
    from engine.distributed import TPError

    try:
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed
        )
        start = time.perf_counter()
        parallel = config_from_args(ParallelConfig, args)
        llm = LLM(args.model, device=args.device, dtype=args.dtype, **asdict(parallel))
        load_s = time.perf_counter() - start
        start = time.perf_counter()
        try:
            if args.chat:
                out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
            else:
                out = llm.generate([args.prompt], params)[0]
        finally:
            llm.close()
        gen_s = time.perf_counter() - start
    except (InvalidRequestError, FileNotFoundError, ValueError) as exc:
        print(f"pd-generate: {exc}", file=sys.stderr)
        return 2
    except TPError as exc:
        print(f"pd-generate: {exc}", file=sys.stderr)
        return 1
    print(out.text)
    print(
        f"[{len(out.token_ids)} tokens, finish={out.finish_reason}, load {load_s:.1f}s, "
        f"generate {gen_s:.2f}s]",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
