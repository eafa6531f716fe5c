"""Offline throughput: the engine vs Hugging Face transformers `generate`, same machine, same
weights, same workload, same dtype (default model, CPU, fp32 unless --dtype, greedy).

    python -m benchmarks.engine.bench_offline [--num-requests 64] [--decode-tokens 128] [--dtype bfloat16]

Prints decode tokens/s at batch 1 and aggregate output tokens/s for a mixed workload, for the
engine, transformers one request at a time, and transformers batched (left-padded batches),
with the ratios beside their targets (>= 1.0x at batch 1, >= 10x aggregate).
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

import torch

from engine import LLM, SamplingParams

Workload = list[tuple[list[int], int]]  # (prompt token ids, output tokens) per request


def mixed_workload(num_requests: int, vocab_size: int, seed: int = 0) -> Workload:
    rng = random.Random(seed)
    workload: Workload = []
    for _ in range(num_requests):
        prompt_len = rng.randint(16, 256)
        output_len = rng.randint(32, 128)
        workload.append(([rng.randrange(100, vocab_size) for _ in range(prompt_len)], output_len))
    return workload


def engine_decode_rate(llm: LLM, prompt: list[int], num_tokens: int) -> float:
    def run(n: int) -> float:
        start = time.perf_counter()
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        return time.perf_counter() - start

    run(4)  # warm-up
    return (num_tokens - 1) / (run(num_tokens) - run(1))


def hf_decode_rate(model: Any, prompt: list[int], num_tokens: int) -> float:
    ids = torch.tensor([prompt])

    def run(n: int) -> float:
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        return time.perf_counter() - start

    run(4)
    return (num_tokens - 1) / (run(num_tokens) - run(1))


def engine_aggregate(llm: LLM, workload: Workload) -> float:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in workload]
    start = time.perf_counter()
    outs = llm.generate([p for p, _ in workload], params)
    elapsed = time.perf_counter() - start
    return sum(len(o.token_ids) for o in outs) / elapsed


def hf_one_by_one(model: Any, workload: Workload) -> float:
    start = time.perf_counter()
    total = 0
    for prompt, n in workload:
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
        total += out.shape[1] - len(prompt)
    return total / (time.perf_counter() - start)


def hf_batched(model: Any, workload: Workload, batch_size: int) -> float:
    """Left-padded batches; each batch runs to its longest request; only requested tokens count."""
    start = time.perf_counter()
    useful = 0
    for i in range(0, len(workload), batch_size):
        batch = workload[i : i + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, (prompt, _) in enumerate(batch):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        n = max(out_len for _, out_len in batch)
        model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
        useful += sum(out_len for _, out_len in batch)
    return useful / (time.perf_counter() - start)


Row = tuple[str, float, float, float | None]  # figure, pdserve, HF, target ratio (or none)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="the weights' and activations' dtype, the same for both (bfloat16: the GEMMs take "
        "the CPU's bf16 instructions, AMX or AVX512-BF16, where it has them)",
    )
    return parser.parse_args()


def measure(llm: LLM, hf: Any, args: argparse.Namespace) -> list[Row]:
    """Batch-1 decode, then the mixed workload against HF one by one and batched."""
    vocab_size = llm.engine.arch.vocab_size
    prompt = mixed_workload(1, vocab_size, seed=1)[0][0][:32]
    workload = mixed_workload(args.num_requests, vocab_size)
    with torch.inference_mode():
        decode = engine_decode_rate(llm, prompt, args.decode_tokens)
        rows: list[Row] = [
            ("decode tok/s, batch 1", decode, hf_decode_rate(hf, prompt, args.decode_tokens), 1.0)
        ]
        ours = engine_aggregate(llm, workload)
        name = f"aggregate tok/s, {len(workload)} req vs HF"
        rows.append((f"{name} one by one", ours, hf_one_by_one(hf, workload), 10.0))
        hf_rate = hf_batched(hf, workload, args.hf_batch_size)
        rows.append((f"{name} batched x{args.hf_batch_size}", ours, hf_rate, None))
    return rows


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)

    from transformers import AutoModelForCausalLM

    llm = LLM(args.model, device="cpu", dtype=args.dtype)
    checkpoint_dir = llm.engine.loaded.tokenizer_dir  # the (converted) HF folder
    if checkpoint_dir is None:
        raise SystemExit(f"{args.model} has no Hugging Face folder for transformers to load")
    dtype = getattr(torch, args.dtype)
    hf = AutoModelForCausalLM.from_pretrained(checkpoint_dir, torch_dtype=dtype).eval()
    rows = measure(llm, hf, args)

    print(f"\nmodel {args.model}, CPU {args.dtype}, torch threads {torch.get_num_threads()}")
    print(f"{'figure':<52} {'pdserve':>10} {'HF':>10} {'ratio':>7} {'target':>7}")
    for name, mine, theirs, target in rows:
        target_text = f">={target:.1f}x" if target else "-"
        print(f"{name:<52} {mine:>10.1f} {theirs:>10.1f} {mine / theirs:>6.2f}x {target_text:>7}")


if __name__ == "__main__":
    main()
