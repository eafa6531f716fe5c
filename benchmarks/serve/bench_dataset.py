"""`pd-bench dataset`: sample a `pd-bench serve` dataset into a JSONL file, so a small sample
travels where the data (or the tokenizer) is not, e.g. to the GPU machine.

    pd-bench dataset --tokenizer DIR --dataset sharegpt --num-prompts 500 --out sample.jsonl
    pd-bench serve --dataset jsonl --dataset-path sample.jsonl ...

One {"prompt", "prompt_token_ids", "max_tokens", "prompt_len"} per line (--ids-only: no text).
Token ids are those of the tokenizer used here; a `synthetic:` model (no tokenizer) takes them
as they are. --max-model-len bounds the lengths as the served model's context would.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from benchmarks.serve.bench_serve import add_dataset_flags, dataset_spec
from benchmarks.serve.datasets import load_requests, save_jsonl
from pdserve.tokenizer import Tokenizer


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pd-bench dataset", description=__doc__.split("\n\n")[0], allow_abbrev=False
    )
    add_dataset_flags(parser)
    parser.add_argument("--out", required=True, metavar="FILE", help="the JSONL file to write")
    parser.add_argument("--max-model-len", type=int, default=2048,
                        help="context length the lengths must fit (default 2048)")  # fmt: skip
    parser.add_argument("--vocab-size", type=int, default=32000,
                        help="random / prefix: token ids below this (default 32000)")  # fmt: skip
    parser.add_argument("--ids-only", action="store_true", help="leave the prompt text out")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    tokenizer = Tokenizer.from_dir(args.tokenizer) if args.tokenizer else None
    try:
        requests = load_requests(dataset_spec(args), tokenizer, args.max_model_len, args.vocab_size)
    except (ValueError, OSError) as error:
        print(f"pd-bench dataset: {error}", file=sys.stderr)
        return 1
    if args.ids_only:
        requests = [replace(r, prompt=None) for r in requests]
    save_jsonl(requests, args.out)
    mean_in = sum(r.prompt_len for r in requests) / max(len(requests), 1)
    mean_out = sum(r.max_tokens for r in requests) / max(len(requests), 1)
    print(f"wrote {len(requests)} requests to {args.out} "
          f"(mean prompt {mean_in:.0f} tokens, mean max_tokens {mean_out:.0f})")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
