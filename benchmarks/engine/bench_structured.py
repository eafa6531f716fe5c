"""Structured outputs: compile time, TTFT with a cold and a cached schema, and the grammar
mask's cost on a decode step.

    python -m benchmarks.engine.bench_structured [--sections compile,ttft,mask]
        [--model synthetic:llama3-8b] [--dtype bfloat16] [--batch-size 32] [--context 1024]
        [--steps 64] [--warmup-steps 8] [--ttft-model smollm2-135m] [--tokenizer-model smollm2-135m]
    CPU, small: ... --device cpu --dtype float32 --model synthetic:tiny-llama:vocab=49152
        --batch-size 4 --context 32 --steps 8 --warmup-steps 2

- compile: every spec of benchmarks/data/structured_outputs.json through a fresh
  `StructuredOutputManager` (a cache miss: what a request with a new schema waits for), then
  again (a hit); p50 / p99 / max.
- ttft: `--ttft-model` (a real model and tokenizer): one request at a time, compile (or hit)
  + make_request + steps until its first token; a new schema each time (cold), the same one
  again (cached), and no schema.
- mask: `--model` at `--batch-size` x `--context` (admitted as bench_engine does: KV in place,
  no prefill), every request under a JSON schema (an array of a corpus schema's objects, at
  least 10000 items: it never ends within the run), against the same batch unconstrained; the
  time per `EngineCore.step()` and the host time building each step's masks. A synthetic
  model has no tokenizer: `--tokenizer-model`'s (smollm2's 49152 ids) is used, the model's
  ids beyond it never allowed; its EOS stands for the model's (the grammars never end here).
  Target: constrained <= 1.05x unconstrained.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

from engine.engine_core import EngineCore
from engine.model.sources import resolve_model_source
from engine.structured import (
    GrammarMask,
    GrammarMatcher,
    StructuredOutputManager,
    load_grammar_compiler,
)
from pdserve.config import EngineConfig
from pdserve.sampling_params import SamplingParams
from pdserve.structured_output import StructuredOutputParams

CORPUS = Path(__file__).parents[1] / "data" / "structured_outputs.json"
MIN_ITEMS = 10_000


def corpus_specs() -> list[StructuredOutputParams]:
    doc = json.loads(CORPUS.read_text(encoding="utf-8"))
    specs = [StructuredOutputParams.json_schema(s) for s in doc["json_schemas"].values()]
    specs += [StructuredOutputParams.regex(r) for r in doc["regexes"].values()]
    specs += [StructuredOutputParams.choice(c) for c in doc["choices"].values()]
    specs += [StructuredOutputParams.grammar(g) for g in doc["grammars"].values()]
    return specs


def summary(values: list[float], unit: float = 1e3, name: str = "ms") -> str:
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return (
        f"p50 {statistics.median(ordered) * unit:8.2f}  p99 {p99 * unit:8.2f}  "
        f"max {ordered[-1] * unit:8.2f} {name}  (n={len(ordered)})"
    )


def make_engine(args: argparse.Namespace, model: str, max_seqs: int) -> EngineCore:
    config = EngineConfig.from_kwargs(
        model=model, dtype=args.dtype, device=args.device, max_num_seqs=max_seqs,
        max_model_len=args.context + args.steps + args.warmup_steps + 64,
        async_scheduling=args.async_scheduling, enable_prefix_caching=False,
    )  # fmt: skip
    return EngineCore(config)


# ---- compile ----------------------------------------------------------------------------


def compile_section(args: argparse.Namespace) -> None:
    source = resolve_model_source(args.tokenizer_model)
    assert source.tokenizer_dir is not None, f"{args.tokenizer_model} has no tokenizer"
    arch = source.arch
    manager = StructuredOutputManager.for_model(source.tokenizer_dir, arch)
    cold, hit = [], []
    for spec in corpus_specs():
        params = SamplingParams(structured_output=spec)
        start = time.perf_counter()
        manager.compile(params)
        cold.append(time.perf_counter() - start)
        start = time.perf_counter()
        manager.compile(params)
        hit.append(time.perf_counter() - start)
    print(f"compile ({args.tokenizer_model}, vocab {arch.vocab_size}), through the manager:")
    print(f"  cold (a new spec)  {summary(cold)}")
    print(f"  cached             {summary(hit, 1e6, 'us')}")


# ---- TTFT -------------------------------------------------------------------------------


def first_token_s(
    core: EngineCore, request_id: str, prompt: list[int], params: SamplingParams
) -> float:
    start = time.perf_counter()
    grammar = core.structured.compile(params)
    core.add_request(core.make_request(request_id, prompt, params, grammar=grammar))
    while not any(out.new_token_ids for out in core.step()):
        pass
    elapsed = time.perf_counter() - start
    core.abort(request_id)
    while core.has_unfinished():
        core.step()
    return elapsed


def ttft_section(args: argparse.Namespace) -> None:
    core = make_engine(args, args.ttft_model, 8)
    schemas = list(json.loads(CORPUS.read_text(encoding="utf-8"))["json_schemas"].values())
    prompt = [(11 * i) % 1000 + 100 for i in range(args.ttft_prompt_len)]
    ids = itertools.count()
    times: dict[str, list[float]] = {"none": [], "cold": [], "cached": []}
    for round_ in range(args.ttft_rounds):
        for schema in schemas:
            fresh = {**schema, "description": f"round {round_} of {args.ttft_rounds}"}
            spec = StructuredOutputParams.json_schema(fresh)  # a digest never seen: cold
            for mode, params in (
                ("none", SamplingParams(max_tokens=4)),
                ("cold", SamplingParams(max_tokens=4, structured_output=spec)),
                ("cached", SamplingParams(max_tokens=4, structured_output=spec)),
            ):
                times[mode].append(first_token_s(core, f"t{next(ids)}", prompt, params))
    print(f"TTFT ({args.ttft_model}, {core.device}, prompt {len(prompt)} tokens, one at a time):")
    for mode, values in times.items():
        print(f"  {mode:7s} schema   {summary(values)}")
    core.check_no_leaks()


# ---- mask overhead ----------------------------------------------------------------------


def attach_tokenizer(core: EngineCore, tokenizer_model: str) -> None:
    """A synthetic model's grammars on `tokenizer_model`'s tokenizer (ids beyond it never
    allowed); its EOS stands for the model's."""
    if core.structured.compiler is not None:
        return
    source = resolve_model_source(tokenizer_model)
    assert source.tokenizer_dir is not None, f"{tokenizer_model} has no tokenizer"
    compiler = load_grammar_compiler(
        source.tokenizer_dir / "tokenizer.json", core.arch.vocab_size, source.arch.eos_token_ids
    )
    core.structured = StructuredOutputManager(compiler)
    core.runner.token_bitmask = core.structured.token_bitmask(core.device)


def decode_step_s(
    core: EngineCore, args: argparse.Namespace, constrained: bool, build_s: list[float]
) -> float:
    """Time per step of `--batch-size` decodes at `--context`; `build_s` gets the host time
    of each step's mask build."""
    schemas = list(json.loads(CORPUS.read_text(encoding="utf-8"))["json_schemas"].values())
    first = 11
    for i in range(args.batch_size):
        params = SamplingParams(max_tokens=args.steps + args.warmup_steps + 4, ignore_eos=True,
                                temperature=0.0)  # fmt: skip
        grammar = None
        if constrained:
            items = {"type": "array", "items": schemas[i % len(schemas)], "minItems": MIN_ITEMS}
            params.structured_output = StructuredOutputParams.json_schema(items)
            grammar = core.structured.compile(params)
            assert core.structured.compiler is not None
            first = core.structured.compiler.tokenizer.tokenize_str("[")[0]
        rid = f"{'c' if constrained else 'u'}{i}"
        prompt = [(7 * j + i) % 500 + 10 for j in range(args.context)]
        request = core.make_request(rid, prompt, params, grammar=grammar)
        core.add_prefilled(request, core.reserve(rid, args.context + 1), first_token=first)
    for _ in range(args.warmup_steps):
        core.step()
    build_s.clear()
    start = time.perf_counter()
    for _ in range(args.steps):
        core.step()
    elapsed = time.perf_counter() - start
    for i in range(args.batch_size):
        core.abort(f"{'c' if constrained else 'u'}{i}")
    while core.has_unfinished():
        core.step()
    return elapsed / args.steps


def mask_section(args: argparse.Namespace) -> None:
    core = make_engine(args, args.model, args.batch_size)
    attach_tokenizer(core, args.tokenizer_model)
    bitmask = core.runner.token_bitmask
    assert bitmask is not None
    build_s: list[float] = []
    build = bitmask.build

    def timed_build(matchers: Sequence[GrammarMatcher | None]) -> GrammarMask | None:
        start = time.perf_counter()
        mask = build(matchers)
        if mask is not None:
            build_s.append(time.perf_counter() - start)
        return mask

    bitmask.build = timed_build  # type: ignore[method-assign]
    rounds = [(c, decode_step_s(core, args, c, build_s)) for c in (False, True, False, True)]
    free = statistics.median(s for c, s in rounds if not c)
    bound = statistics.median(s for c, s in rounds if c)
    print(f"decode step ({args.model}, {core.device}, batch {args.batch_size} x context "
          f"{args.context}, async scheduling {core.async_scheduling}), rounds in turn:")  # fmt: skip
    for c, s in rounds:
        print(f"  {'constrained  ' if c else 'unconstrained'}  {s * 1e3:8.3f} ms/step")
    print(f"  ratio constrained / unconstrained: {bound / free:.3f}x (target <= 1.05x)")
    print(f"  mask build on the host per step: {summary(build_s)}")
    core.check_no_leaks()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sections", default="compile,ttft,mask")
    p.add_argument("--model", default="synthetic:llama3-8b")
    p.add_argument("--ttft-model", default="smollm2-135m")
    p.add_argument("--tokenizer-model", default="smollm2-135m")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--async-scheduling", default="auto")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--warmup-steps", type=int, default=8)
    p.add_argument("--ttft-rounds", type=int, default=2)
    p.add_argument("--ttft-prompt-len", type=int, default=256)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    sections = {"compile": compile_section, "ttft": ttft_section, "mask": mask_section}
    for name in args.sections.split(","):
        sections[name.strip()](args)


if __name__ == "__main__":
    main()
