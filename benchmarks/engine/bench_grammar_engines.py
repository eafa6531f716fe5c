"""xgrammar against llguidance on one tokenizer: what engine/structured/ was chosen by.

```
python -m benchmarks.engine.bench_grammar_engines [--model smollm2-135m] [--hostile-timeout-s 20]
```

Needs both libraries (`pip install xgrammar==0.2.9 llguidance==1.9.1`; pdserve depends on
llguidance only). For each engine, on the model's tokenizer.json:
- setup: tokenizer.json -> the engine's tokenizer object, ready to compile (imports apart);
- compile: every spec of benchmarks/data/structured_outputs.json (JSON schemas, regexes,
  choices, Lark grammars), no cache, one thread, until the first mask is known (llguidance
  builds its lexer lazily, so its compile alone would flatter it); p50 / p99 / max;
- mask: the time to fill one token's bitmask row along a seeded random walk through each spec
  (a random allowed token accepted each step, 64 steps at most); p50 / p99 / max;
- hostile: each hostile spec in its own process under an 8 GiB address space, timed from the
  moment its tokenizer is ready (a loaded machine's imports stay out of the limit): the outcome
  (error and its first words, timeout, crash), seconds and peak RSS.

Wall-clock times and, beside them, the CPU time of the measuring thread (both engines compute
on the calling thread here): on a shared machine the CPU time is the steadier figure.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import select
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

CORPUS = Path(__file__).parents[1] / "data" / "structured_outputs.json"
ENGINES = ("xgrammar", "llguidance")
MAX_WALK_STEPS = 64
SETUP_TIMEOUT_S = 600.0  # a child's imports and tokenizer, on a loaded machine


def hostile_specs() -> dict[str, tuple[str, str]]:
    """name -> (kind, spec text): inputs a server must refuse in bounded time and memory."""
    depth = 3000  # built as text: json.dumps itself recurses once per level
    nested = '{"type":"object","properties":{"a":' * depth + '{"type":"integer"}' + "}}" * depth
    many_props = {f"p{i}": {"type": "string"} for i in range(20000)}
    return {
        "deep_nesting_3000": ("json", nested),
        "huge_enum_200k": ("json", json.dumps({"enum": [f"value-{i}" for i in range(200_000)]})),
        "many_properties_20k": ("json", json.dumps({"type": "object", "properties": many_props})),
        "min_items_1e6": ("json", json.dumps({"type": "array", "minItems": 1_000_000})),
        "max_length_1e7": ("json", json.dumps({"type": "string", "maxLength": 10_000_000})),
        "self_ref": ("json", json.dumps({"$ref": "#"})),
        "unknown_ref": ("json", json.dumps({"$ref": "#/$defs/missing"})),
        "not_json": ("json", "{'type': 'object'"),
        "regex_dfa_blowup": ("regex", "(a|b)*a(a|b){40}"),
        "regex_nested_quantifiers": ("regex", "((a+)+)+b"),
        "regex_repeat_bomb": ("regex", "((x{1000}){1000}){1000}"),
        "regex_invalid": ("regex", "(unclosed[a-"),
        "grammar_invalid": ("grammar", "start: missing_rule\n"),
    }


# ---- the two engines behind one face -----------------------------------------------------


class XgrammarEngine:
    def __init__(self, tokenizer_dir: Path, vocab_size: int, eos_ids: list[int]) -> None:
        import tokenizers
        import transformers
        import xgrammar

        self.xgr = xgrammar
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
        hf = transformers.PreTrainedTokenizerFast(tokenizer_object=backend)
        info = xgrammar.TokenizerInfo.from_huggingface(
            hf, vocab_size=vocab_size, stop_token_ids=eos_ids
        )
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.vocab_size = vocab_size

    def compile(self, kind: str, spec: str) -> Any:
        if kind == "json":
            return self.compiler.compile_json_schema(spec, any_whitespace=False)
        if kind == "regex":
            return self.compiler.compile_regex(spec)
        return self.compiler.compile_lark(spec)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher: Any, bitmask: Any) -> None:
        matcher.fill_next_token_bitmask(bitmask, 0)

    def accept(self, matcher: Any, token_id: int) -> bool:
        return bool(matcher.accept_token(token_id))

    def done(self, matcher: Any) -> bool:
        return bool(matcher.is_terminated())


class LlguidanceEngine:
    def __init__(self, tokenizer_dir: Path, vocab_size: int, eos_ids: list[int]) -> None:
        import llguidance
        import llguidance.torch

        self.llg = llguidance
        text = (tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8")
        self.tokenizer = llguidance.LLTokenizer(text, n_vocab=vocab_size, eos_token=eos_ids)
        self.vocab_size = vocab_size

    def compile(self, kind: str, spec: str) -> Any:
        matcher_type = self.llg.LLMatcher
        if kind == "json":
            grammar = matcher_type.grammar_from_json_schema(
                spec, defaults={"whitespace_flexible": False}
            )
        elif kind == "regex":
            grammar = matcher_type.grammar_from_regex(spec)
        else:
            grammar = matcher_type.grammar_from_lark(spec)
        matcher = matcher_type(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def matcher(self, compiled: Any) -> Any:
        return compiled.deep_copy()

    def fill(self, matcher: Any, bitmask: Any) -> None:
        self.llg.torch.fill_next_token_bitmask(matcher, bitmask, 0)

    def accept(self, matcher: Any, token_id: int) -> bool:
        return bool(matcher.consume_token(token_id))

    def done(self, matcher: Any) -> bool:
        return bool(matcher.is_stopped())


def make_engine(name: str, tokenizer_dir: Path, vocab_size: int, eos_ids: list[int]) -> Any:
    cls = XgrammarEngine if name == "xgrammar" else LlguidanceEngine
    return cls(tokenizer_dir, vocab_size, eos_ids)


# ---- measurements --------------------------------------------------------------------------


def corpus_specs() -> list[tuple[str, str, str]]:
    """(name, kind, spec) of every corpus entry; a choice becomes its regex."""
    import re

    doc = json.loads(CORPUS.read_text(encoding="utf-8"))
    specs = [(n, "json", json.dumps(s)) for n, s in doc["json_schemas"].items()]
    specs += [(n, "regex", r) for n, r in doc["regexes"].items()]
    specs += [(n, "regex", "|".join(map(re.escape, c))) for n, c in doc["choices"].items()]
    specs += [(n, "grammar", g) for n, g in doc["grammars"].items()]
    return specs


def allowed_ids(bitmask: Any, vocab_size: int) -> list[int]:
    import numpy as np

    bits = np.unpackbits(bitmask[0].numpy().view(np.uint8), bitorder="little")
    return np.flatnonzero(bits[:vocab_size]).tolist()


def walk(engine: Any, compiled: Any, bitmask: Any, rng: random.Random) -> list[tuple[float, float]]:
    """(wall, CPU) seconds of each mask fill along one random walk through the grammar."""
    matcher = engine.matcher(compiled)
    times: list[tuple[float, float]] = []
    for _ in range(MAX_WALK_STEPS):
        start, cpu = time.perf_counter(), time.thread_time()
        engine.fill(matcher, bitmask)
        times.append((time.perf_counter() - start, time.thread_time() - cpu))
        allowed = allowed_ids(bitmask, engine.vocab_size)
        if not allowed or engine.done(matcher):
            break
        if not engine.accept(matcher, rng.choice(allowed)) or engine.done(matcher):
            break
    return times


def measure(name: str, tokenizer_dir: Path, vocab_size: int, eos_ids: list[int]) -> dict:
    import torch

    start, cpu_start = time.perf_counter(), time.process_time()
    engine = make_engine(name, tokenizer_dir, vocab_size, eos_ids)
    setup_s, setup_cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
    bitmask = torch.full((1, (vocab_size + 31) // 32), -1, dtype=torch.int32)
    compile_s: list[tuple[float, float]] = []
    mask_s: list[tuple[float, float]] = []
    rng = random.Random(0)
    for _spec_name, kind, spec in corpus_specs():
        start, cpu = time.perf_counter(), time.thread_time()
        compiled = engine.compile(kind, spec)
        engine.fill(engine.matcher(compiled), bitmask)  # the first mask: what TTFT waits for
        compile_s.append((time.perf_counter() - start, time.thread_time() - cpu))
        mask_s += walk(engine, compiled, bitmask, rng)
    return {"engine": name, "setup_s": setup_s, "setup_cpu_s": setup_cpu_s,
            "compile_s": compile_s, "mask_s": mask_s}  # fmt: skip


def percentiles(pairs: list[tuple[float, float]], unit: str = "ms") -> str:
    """Wall-clock percentiles, then the CPU time's."""
    return f"wall {_percentiles([w for w, _ in pairs], unit)}\n{' ' * 24}CPU  " + _percentiles(
        [c for _, c in pairs], unit
    )


def _percentiles(values: list[float], unit: str) -> str:
    scale = {"ms": 1e3, "us": 1e6}[unit]
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return (
        f"p50 {statistics.median(ordered) * scale:8.1f}  p99 {p99 * scale:8.1f}  "
        f"max {ordered[-1] * scale:8.1f} {unit}  (n={len(ordered)})"
    )


def run_hostile(name: str, case: str, args: argparse.Namespace) -> str:
    """One hostile spec in a child process (8 GiB of address space), killed
    `--hostile-timeout-s` after its tokenizer is ready."""
    cmd = [sys.executable, "-m", "benchmarks.engine.bench_grammar_engines", "--child", name, case,
           "--model", args.model]  # fmt: skip
    proc = subprocess.Popen(  # unbuffered: readline takes "ready" and nothing after it
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30)),
    )  # fmt: skip
    assert proc.stdout is not None
    try:
        if not select.select([proc.stdout], [], [], SETUP_TIMEOUT_S)[0]:
            raise subprocess.TimeoutExpired(cmd, SETUP_TIMEOUT_S)
        proc.stdout.readline()  # "ready": the limit starts now
        start = time.perf_counter()
        out, err = proc.communicate(timeout=args.hostile_timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return f"TIMEOUT after {args.hostile_timeout_s:.0f} s"
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        tail = (err.decode(errors="replace").strip().splitlines() or ["?"])[-1][:90]
        return f"crash rc={proc.returncode} after {elapsed:.1f} s: {tail}"
    return str(out.decode(errors="replace").strip().splitlines()[-1])


def child(name: str, case: str, model: str) -> None:
    """In the child: set up, compile the hostile spec, fill its first mask; print the outcome."""
    tokenizer_dir, vocab_size, eos_ids = model_tokenizer(model)
    engine = make_engine(name, tokenizer_dir, vocab_size, eos_ids)
    import torch

    kind, spec = hostile_specs()[case]
    print("ready", flush=True)
    start = time.perf_counter()
    try:
        compiled = engine.compile(kind, spec)
        bitmask = torch.full((1, (vocab_size + 31) // 32), -1, dtype=torch.int32)
        engine.fill(engine.matcher(compiled), bitmask)
        outcome = "ACCEPTED"
    except Exception as exc:  # the library's own error: what a client would be told
        outcome = f"error {type(exc).__name__}: {str(exc).splitlines()[0][:70]!r}"
    rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{outcome} in {time.perf_counter() - start:.2f} s, peak RSS {rss_mib:.0f} MiB")


def model_tokenizer(model: str) -> tuple[Path, int, list[int]]:
    from engine.model.sources import resolve_model_source

    source = resolve_model_source(model)
    if source.tokenizer_dir is None:
        raise SystemExit(f"{model} has no tokenizer.json")
    arch = source.arch
    return source.tokenizer_dir, arch.vocab_size, list(arch.eos_token_ids)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--hostile-timeout-s", type=float, default=20.0)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child[0], args.child[1], args.model)
        return
    tokenizer_dir, vocab_size, eos_ids = model_tokenizer(args.model)
    print(f"model {args.model}: vocab {vocab_size}, {len(corpus_specs())} corpus specs")
    for name in ENGINES:
        start = time.perf_counter()
        __import__(name)
        import_s = time.perf_counter() - start
        result = measure(name, tokenizer_dir, vocab_size, eos_ids)
        print(
            f"\n{name}: import {import_s:.2f} s, tokenizer setup {result['setup_s']:.2f} s "
            f"(CPU {result['setup_cpu_s']:.2f} s)"
        )
        print(f"  compile + first mask  {percentiles(result['compile_s'])}")
        print(f"  mask fill per token   {percentiles(result['mask_s'], 'us')}")
        for case in hostile_specs():
            print(f"  hostile {case:26s} {run_hostile(name, case, args)}")


if __name__ == "__main__":
    main()
