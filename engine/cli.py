"""`pd-generate`: offline generation with the engine (no servers), for a quick local check.

pd-generate "Write a haiku about GPUs" --max-tokens 48
pd-generate --chat "What is the capital of France?"
pd-generate --tensor-parallel-size 3 "Hello"   (smollm2-135m's 9 heads over 3 ranks)

Sampling flags left out take the model's defaults, as every entry point does (its generation
config's, or its model card's: pdserve.sampling_params).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from dataclasses import asdict

from pdserve.cli import ArgumentParser, add_config_flags, config_from_args
from pdserve.config import DEFAULT_MODEL, ParallelConfig
from pdserve.logs import configure_logging
from pdserve.sampling_defaults import default_help

DEFAULT_PROMPT = "What is the capital of France?"


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="pd-generate", description=__doc__.split("\n")[0])
    p.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT,
                   help=f"the prompt (default: {DEFAULT_PROMPT!r})")  # fmt: skip
    p.add_argument("--chat", action="store_true",
                   help="render the prompt as a user message with the model's chat template")  # fmt: skip
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"(default: {DEFAULT_MODEL})")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default: auto)")
    p.add_argument("--dtype", default="auto", help="(default: auto: the checkpoint's)")
    p.add_argument("--max-tokens", type=int, default=None, help=f"({default_help('max_tokens')})")
    p.add_argument("--temperature", type=float, default=None,
                   help=f"0: greedy ({default_help('temperature')})")  # fmt: skip
    p.add_argument("--top-p", type=float, default=None, help=f"({default_help('top_p')})")
    p.add_argument("--seed", type=int, default=None, help="(default: none: unseeded)")
    add_config_flags(p, p.add_argument_group("tensor parallelism"), ParallelConfig, ())
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # INFO: a cold start's conversion and loading progress (a bar instead on a terminal)
    configure_logging("info", "generate")
    from engine import LLM, InvalidRequestError
    from engine.distributed import TPError

    try:
        start = time.perf_counter()
        parallel = config_from_args(ParallelConfig, args)
        llm = LLM(args.model, device=args.device, dtype=args.dtype, **asdict(parallel))
        load_s = time.perf_counter() - start
        given = {
            name: getattr(args, name)
            for name in ("max_tokens", "temperature", "top_p", "seed")
            if getattr(args, name) is not None
        }
        params = dataclasses.replace(llm.default_sampling_params(), **given)
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
