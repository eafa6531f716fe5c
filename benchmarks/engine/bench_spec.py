"""pd-bench spec: speculative decoding end to end, batch 1: output tokens/s with and without it
on the same prompts, whether the outputs are the same, and how many drafts were accepted.

    pd-bench spec [--dataset grounded|sharegpt|PATH.jsonl] [--num-prompts 24]
                  [--speculative-method ngram] [--num-speculative-tokens 4]
                  [--model smollm2-135m] [--device cpu] [--dtype float32]

Two engines (the same model and settings; one speculates) run every prompt one at a time,
greedy; the two runs of a prompt follow each other, the order alternating from prompt to
prompt, so a slow spell of a shared machine falls on both. Datasets: `grounded`
(benchmarks/data/spec_grounded.jsonl: answers that copy spans of the prompt: edit, rewrite,
reformat code and text), `sharegpt` (benchmarks/data/sharegpt_smollm2_500.jsonl: chat), or a
JSONL file of {"messages": [...]} or {"prompt": "..."} with "max_tokens". Chat prompts go
through the model's chat template; max_tokens is capped by --max-tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.serve.report import write_json
from engine import LLM, SamplingParams
from pdserve.config import ASYNC_SCHEDULING, DTYPES, parse_size
from pdserve.engine_config import SPECULATIVE_METHODS

DATA = Path(__file__).resolve().parents[1] / "data"
DATASETS = {
    "grounded": DATA / "spec_grounded.jsonl",
    "sharegpt": DATA / "sharegpt_smollm2_500.jsonl",
}


@dataclass
class Totals:
    seconds: float = 0.0
    output_tokens: int = 0
    per_prompt_tok_s: list[float] = field(default_factory=list)

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pd-bench spec", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=DTYPES)
    p.add_argument("--dataset", default="grounded", help="grounded | sharegpt | a JSONL path")
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=256, help="cap of each prompt's max_tokens")
    p.add_argument("--speculative-method", default="ngram", choices=SPECULATIVE_METHODS)
    p.add_argument("--speculative-model", default=None)
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--ngram-prompt-lookup-min", type=int, default=2)
    p.add_argument("--ngram-prompt-lookup-max", type=int, default=4)
    p.add_argument("--async-scheduling", default="auto", choices=ASYNC_SCHEDULING)
    p.add_argument(
        "--kv-cache-memory",
        type=parse_size,
        default=parse_size("256MiB"),
        help="each engine's KV cache (batch 1 needs little; default: 256MiB)",
    )
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    return p.parse_args(argv)


def load_prompts(llm: LLM, dataset: str, num_prompts: int, cap: int) -> list[tuple[list[int], int]]:
    """(prompt token ids, max_tokens) of the dataset's first `num_prompts` entries."""
    path = DATASETS.get(dataset, Path(dataset))
    tokenizer = llm.tokenizer
    if tokenizer is None:
        raise SystemExit(f"{llm.engine.loaded.name} has no tokenizer: pd-bench spec needs one")
    prompts = []
    for line in path.read_text(encoding="utf-8").splitlines()[:num_prompts]:
        entry = json.loads(line)
        messages = entry.get("messages") or [{"role": "user", "content": entry["prompt"]}]
        ids = tokenizer.encode(tokenizer.apply_chat_template(messages))  # as LLM.chat does
        prompts.append((ids, min(int(entry.get("max_tokens", cap)), cap)))
    return prompts


def timed(llm: LLM, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    start = time.perf_counter()
    (out,) = llm.generate([prompt], params)
    return time.perf_counter() - start, out.token_ids


def run(args: argparse.Namespace) -> dict[str, Any]:
    common = dict(
        device=args.device, dtype=args.dtype, async_scheduling=args.async_scheduling,
        kv_cache_memory=args.kv_cache_memory,
    )  # fmt: skip
    plain = LLM(args.model, **common)
    spec = LLM(
        args.model, **common, speculative_method=args.speculative_method,
        speculative_model=args.speculative_model,
        num_speculative_tokens=args.num_speculative_tokens,
        ngram_prompt_lookup_min=args.ngram_prompt_lookup_min,
        ngram_prompt_lookup_max=args.ngram_prompt_lookup_max,
    )  # fmt: skip
    prompts = load_prompts(plain, args.dataset, args.num_prompts, args.max_tokens)
    for llm in (plain, spec):  # warm-up
        timed(llm, prompts[0][0], 8)
    before = spec.engine.stats().spec_decode
    totals = {"plain": Totals(), "spec": Totals()}
    same = 0
    for i, (prompt, max_tokens) in enumerate(prompts):
        order = [("plain", plain), ("spec", spec)]
        outputs = {}
        for name, llm in order if i % 2 == 0 else order[::-1]:
            seconds, tokens = timed(llm, prompt, max_tokens)
            total = totals[name]
            total.seconds += seconds
            total.output_tokens += len(tokens)
            total.per_prompt_tok_s.append(len(tokens) / seconds)
            outputs[name] = tokens
        same += outputs["plain"] == outputs["spec"]
    after = spec.engine.stats().spec_decode
    drafts = after.num_draft_tokens - before.num_draft_tokens
    verifies = after.num_verifies - before.num_verifies
    return {
        "args": vars(args),
        "load_average": os.getloadavg(),
        "num_prompts": len(prompts),
        "same_outputs": same,
        "plain": asdict(totals["plain"]) | {"tok_s": totals["plain"].tok_s},
        "spec": asdict(totals["spec"]) | {"tok_s": totals["spec"].tok_s},
        "speedup": totals["spec"].tok_s / totals["plain"].tok_s,
        "acceptance_rate": (after.num_accepted_tokens - before.num_accepted_tokens)
        / max(drafts, 1),
        "tokens_per_verify": (after.num_emitted_tokens - before.num_emitted_tokens)
        / max(verifies, 1),
        "num_verifies": verifies,
    }


def format_table(result: dict[str, Any]) -> str:
    a = result["args"]
    method = a["speculative_method"] + (
        f" ({a['speculative_model']})" if a["speculative_model"] else ""
    )
    head = (
        f"pd-bench spec: {a['model']} {a['dtype']} on {a['device']}, batch 1, greedy, dataset "
        f"{a['dataset']} ({result['num_prompts']} prompts, max_tokens <= {a['max_tokens']}), "
        f"{method} K={a['num_speculative_tokens']}, load average "
        f"{' '.join(f'{x:.1f}' for x in result['load_average'])}\n"
    )
    plain, spec = result["plain"], result["spec"]
    lines = [
        "| engine | output tokens | seconds | output tok/s | speedup |", "|---|---|---|---|---|",
        f"| no speculation | {plain['output_tokens']} | {plain['seconds']:.1f} | {plain['tok_s']:.1f} | 1.00x |",
        f"| {method} K={a['num_speculative_tokens']} | {spec['output_tokens']} | {spec['seconds']:.1f} "
        f"| {spec['tok_s']:.1f} | {result['speedup']:.2f}x |",
    ]  # fmt: skip
    tail = (
        f"\nsame outputs: {result['same_outputs']}/{result['num_prompts']} prompts; drafts "
        f"accepted: {result['acceptance_rate']:.0%}; tokens per verify step: "
        f"{result['tokens_per_verify']:.2f} ({result['num_verifies']} verify steps)"
    )
    return head + "\n".join(lines) + tail


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    print(format_table(result), flush=True)
    if args.json:
        write_json(args.json, result)
    return 0 if result["same_outputs"] == result["num_prompts"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
