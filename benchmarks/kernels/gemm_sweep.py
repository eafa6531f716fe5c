"""Skinny GEMM sweep: y = x @ W^T for few tokens, cuBLAS (F.linear) against the Triton skinny
GEMM (kernels/gemm) over a grid of launch settings, on the llama3-8b bf16 projections, CUDA only.

    python -m benchmarks.kernels.gemm_sweep [--shapes qkv,o_proj,gate_up,down,lm_head]
                                    [--ms 1,8,16,32,64,128] [--reps 30] [--grid full|table]

Every call is timed replayed from a CUDA graph (as the engine replays decode steps): one graph
calls the GEMM once on each of `copies` copies of W, enough copies to read ROTATE_BYTES (a model
reads a different layer's W each call; one W of 32 MiB would sit in the 50 MiB L2 cache), and
the time per call is the median replay time (of `--reps`, CUDA events) over the copies. Rates
count W + x + y bytes once; the ceiling is the HBM copy rate measured in the same run (read +
write counted, benchmarks/engine/ceilings.py). Each setting is checked against F.linear on the
same inputs (max abs error, W scaled by 1/sqrt(K) so outputs are ~N(0, 1)) and run twice for
bitwise determinism. The grid per M:

```
table   skinny_gemm_config(M, N, K) (what skinny_linear runs by default), marked "table"
dot     BLOCK_N x BLOCK_K in TILES, 3 and 4 stages, 4 warps (8 too for tiles of 64 x 64 and up),
        the M tile M padded to a power of two >= 16 (for M > 64 also capped at 64: two M tiles)
split   each dot launch of fewer than SPLIT_FILL programs again with K split in SPLITS ways
        (at least MIN_SPLIT_STEPS K steps a program; the reduce launch is in the time)
fma     (M <= 4) the no-dot path over FMA_TILES, 3 and 4 stages, 4 and 8 warps
```

Settings with fewer than MIN_PROGRAMS programs (a GPU half empty) are left out. It prints one
summary table (cuBLAS, the table's launch, the fastest setting, cuBLAS time / fastest time) and
the fastest settings as rows for kernels/gemm/skinny_config.py's table.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from benchmarks.engine.ceilings import memory_bandwidth
from kernels.gemm import SkinnyGemmConfig, skinny_gemm_config

SHAPES = {  # name -> (N, K) of llama3-8b's weight [N, K]
    "qkv": (6144, 4096),
    "o_proj": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}
DTYPE = torch.bfloat16
ROTATE_BYTES = 512 << 20  # W read per replay at least (ten times the L2 cache)
MAX_COPIES = 64
MIN_PROGRAMS = 64
REL_TOLERANCE = 1e-2  # max abs error over max |F.linear|: a few bf16 ulps
TILES = [(16, 256), (16, 512), (32, 128), (32, 256), (64, 64), (64, 128), (128, 64), (128, 128)]
SPLITS = (2, 3, 4)  # split-K factors tried on launches of fewer than SPLIT_FILL programs
SPLIT_FILL = 264  # two programs per SM of an H200 (132 SMs)
MIN_SPLIT_STEPS = 4  # K steps per split program at least (the pipeline's depth)
FMA_TILES = [(4, 512), (8, 256), (8, 512), (16, 128), (16, 256), (16, 512), (32, 128), (64, 64)]


@dataclass(frozen=True)
class Row:
    label: str  # "cublas", "table" or ""
    config: SkinnyGemmConfig | None  # None: cuBLAS
    time_s: float | None  # None: the setting failed (reason in `error`)
    max_err: float = 0.0
    deterministic: bool = True
    error: str = ""

    def ok(self, ref_max: float) -> bool:
        close = self.max_err <= REL_TOLERANCE * ref_max
        return self.time_s is not None and close and self.deterministic

    @property
    def seconds(self) -> float:
        """`time_s` of a setting that ran (ValueError for one that failed)."""
        if self.time_s is None:
            raise ValueError(f"{self.label or self.config} failed: {self.error}")
        return self.time_s


def settings(m: int, n: int, k: int, grid: str) -> list[tuple[str, SkinnyGemmConfig]]:
    """The table's launch, then the grid (unique, fitting, at least MIN_PROGRAMS programs)."""
    table = skinny_gemm_config(m, n, k)
    found = [("table", table)]
    if grid == "table":
        return found
    candidates = []
    for block_m in (128,) if m <= 64 else (64, 128):  # the M tile: M padded, capped by block_m
        for (block_n, block_k), stages in ((t, s) for t in TILES for s in (3, 4)):
            config = SkinnyGemmConfig(block_n, block_k, 4, stages, block_m)
            candidates.append(config)
            if block_n * config.tile_m(m) >= 64 * 64:
                candidates.append(dataclasses.replace(config, num_warps=8))
    candidates += split_candidates(candidates, m, n, k)
    if m <= 4:
        padded_m = 1 << (m - 1).bit_length()
        for (block_n, block_k), stages in ((t, s) for t in FMA_TILES for s in (3, 4)):
            for warps in (4, 8):
                candidates.append(
                    SkinnyGemmConfig(block_n, block_k, warps, stages, padded_m, False)
                )
    for config in candidates:
        enough = config.fits(m) and config.num_programs(m, n) >= MIN_PROGRAMS
        if enough and all(launch_key(config, m) != launch_key(c, m) for _, c in found):
            found.append(("", config))
    return found


def split_candidates(
    candidates: list[SkinnyGemmConfig], m: int, n: int, k: int
) -> list[SkinnyGemmConfig]:
    """Split-K variants of the tl.dot launches that leave SMs idle (fewer than SPLIT_FILL
    programs): every split of SPLITS that keeps at least MIN_SPLIT_STEPS K steps a program
    and at most 2 * SPLIT_FILL programs."""
    found = []
    for config in candidates:
        programs = config.num_programs(m, n)
        if programs >= SPLIT_FILL:
            continue
        for split in SPLITS:
            steps = -(-k // config.block_k) // split
            if steps >= MIN_SPLIT_STEPS and programs * split <= 2 * SPLIT_FILL:
                found.append(dataclasses.replace(config, split_k=split))
    return found


def launch_key(config: SkinnyGemmConfig, m: int) -> tuple:
    """What the launch for M tokens depends on (block_m only through the M tile)."""
    return (config.use_dot, config.tile_m(m), config.block_n, config.block_k,
            config.num_warps, config.num_stages, config.split_k)  # fmt: skip


@dataclass
class Case:
    """One (shape, M): x, `copies` copies of W, and F.linear's output on copy 0."""

    name: str
    x: torch.Tensor  # [M, K]
    weights: torch.Tensor  # [copies, N, K]
    expected: torch.Tensor  # [M, N]

    @property
    def copies(self) -> int:
        return self.weights.shape[0]

    @property
    def num_bytes(self) -> int:
        (m, k), n = self.x.shape, self.weights.shape[1]
        return (n * k + m * k + m * n) * DTYPE.itemsize


def make_case(name: str, m: int, device: torch.device) -> Case:
    n, k = SHAPES[name]
    w_bytes = n * k * DTYPE.itemsize
    copies = max(2, min(MAX_COPIES, -(-ROTATE_BYTES // w_bytes)))
    gen = torch.Generator(device=device).manual_seed(m)
    weights = torch.randn(copies, n, k, device=device, dtype=DTYPE, generator=gen) * k**-0.5
    x = torch.randn(m, k, device=device, dtype=DTYPE, generator=gen)
    return Case(name, x, weights, F.linear(x, weights[0]))


def graph_time_s(fn, copies: int, reps: int) -> float:
    """Median seconds per call over `reps` replays of a graph calling fn(c) for every copy."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for copy in range(copies):
            fn(copy)
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / copies)
    return statistics.median(times)


def time_cublas(case: Case, reps: int) -> Row:
    return Row("cublas", None, graph_time_s(lambda c: F.linear(case.x, case.weights[c]),
                                             case.copies, reps))  # fmt: skip


def time_setting(case: Case, label: str, config: SkinnyGemmConfig, reps: int) -> Row:
    """One launch: checked against F.linear and for determinism eagerly, then timed."""
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources

    from kernels.gemm.skinny_gemm import skinny_linear

    def call(copy: int) -> torch.Tensor:
        return skinny_linear(case.x, case.weights[copy], None, config)

    try:
        out, again = call(0), call(0)
        torch.cuda.synchronize()
    except (OutOfResources, CompilationError) as exc:
        return Row(label, config, None, error=f"{type(exc).__name__}: {exc}".splitlines()[0])
    max_err = (out.float() - case.expected.float()).abs().max().item()
    deterministic = torch.equal(out, again)
    return Row(label, config, graph_time_s(call, case.copies, reps), max_err, deterministic)


def best_row(rows: list[Row], ref_max: float) -> Row | None:
    ok = [r for r in rows if r.config is not None and r.ok(ref_max)]
    return min(ok, key=lambda r: r.seconds) if ok else None


@dataclass(frozen=True)
class Result:
    name: str
    m: int
    num_bytes: int
    ref_max: float
    rows: list[Row]


def run_case(name: str, m: int, reps: int, grid: str, device: torch.device) -> Result:
    case = make_case(name, m, device)
    n, k = SHAPES[name]
    rows = [time_cublas(case, reps)]
    rows += [time_setting(case, label, config, reps) for label, config in settings(m, n, k, grid)]
    result = Result(name, m, case.num_bytes, case.expected.float().abs().max().item(), rows)
    del case
    torch.cuda.empty_cache()
    return result


def _us_rate(row: Row | None, result: Result, copy_bps: float) -> str:
    if row is None or row.time_s is None:
        return "- | - | -"
    rate = result.num_bytes / row.time_s
    return f"{row.time_s * 1e6:.1f} | {rate / 1e12:.2f} | {rate / copy_bps:.0%}"


def summary(results: list[Result], copy_bps: float) -> str:
    """Per (shape, M): cuBLAS, the table's launch and the fastest correct setting."""
    lines = [
        "| shape | M | cuBLAS us | TB/s | of copy | table us | TB/s | of copy | best setting "
        "| best us | TB/s | of copy | cuBLAS / best | best max err | failed/wrong |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: "
        "| ---: | ---: | ---: |",
    ]
    for result in results:
        cublas = next(r for r in result.rows if r.label == "cublas")
        table = next((r for r in result.rows if r.label == "table"), None)
        table = table if table is not None and table.ok(result.ref_max) else None
        best = best_row(result.rows, result.ref_max)
        bad = sum(1 for r in result.rows if r.config is not None and not r.ok(result.ref_max))
        n, k = SHAPES[result.name]
        ratio = "-" if best is None else f"{cublas.seconds / best.seconds:.2f}x"
        lines.append(
            f"| {result.name} {n}x{k} | {result.m} | {_us_rate(cublas, result, copy_bps)} | "
            f"{_us_rate(table, result, copy_bps)} | {'-' if best is None or best.config is None else best.config.label()} "
            f"| {_us_rate(best, result, copy_bps)} | {ratio} | "
            f"{'-' if best is None else f'{best.max_err:.1e}'} | {bad} |"
        )
    return "\n".join(lines)


def config_code(config: SkinnyGemmConfig) -> str:
    fma = "" if config.use_dot else ", use_dot=False"
    split = f", split_k={config.split_k}" if config.split_k > 1 else ""
    return (
        f"SkinnyGemmConfig({config.block_n}, {config.block_k}, {config.num_warps}, "
        f"{config.num_stages}, block_m={config.block_m}{fma}{split})"
    )


def table_rows(results: list[Result]) -> str:
    """The fastest setting per (shape, M) as (M, N, K, config) rows of skinny_config._TABLE,
    sorted by (M, N, K): first match (M <= max_m, N <= max_n, K <= max_k) then picks each
    swept case's own row."""
    rows = []
    for result in results:
        best = best_row(result.rows, result.ref_max)
        n, k = SHAPES[result.name]
        if best is not None and best.config is not None:
            rows.append((result.m, n, k, config_code(best.config)))
    return "\n".join(f"    ({m}, {n}, {k}, {code})," for m, n, k, code in sorted(rows))


def details(result: Result) -> str:
    """Every setting of one (shape, M) on one line."""
    parts = []
    for row in result.rows:
        name = "cublas" if row.config is None else row.config.label()
        name += " (table)" if row.label == "table" else ""
        if row.time_s is None:
            parts.append(f"{name} failed: {row.error}")
            continue
        wrong = "" if row.config is None or row.ok(result.ref_max) else " WRONG"
        parts.append(f"{name} {row.time_s * 1e6:.1f} us{wrong}")
    return f"{result.name} M={result.m}: " + ", ".join(parts)


def parse_list(text: str) -> list[str]:
    return [part for part in text.split(",") if part]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", type=parse_list, default=list(SHAPES))
    parser.add_argument("--ms", type=lambda t: [int(p) for p in parse_list(t)],
                        default=[1, 8, 16, 32, 64, 128])  # fmt: skip
    parser.add_argument("--reps", type=int, default=30, help="graph replays timed per setting")
    parser.add_argument("--grid", choices=("full", "table"), default="full")
    parser.add_argument("--details", action="store_true", help="every setting's time")
    args = parser.parse_args(argv)
    unknown = [name for name in args.shapes if name not in SHAPES]
    if unknown:
        parser.error(f"unknown shapes {unknown}; known: {', '.join(SHAPES)}")
    if not torch.cuda.is_available():
        raise SystemExit("gemm_sweep needs a CUDA device (none is visible)")
    start = time.perf_counter()
    device = torch.device("cuda")
    copy_bps = memory_bandwidth(device, 1 << 30)
    print(f"{torch.cuda.get_device_name()}: HBM copy {copy_bps / 1e12:.2f} TB/s (read + write, "
          f"1 GiB; the ceiling); bf16; times are CUDA-graph replays over W copies, median of "
          f"{args.reps}; setting = kind, BLOCK_N, BLOCK_K, M tile cap, warps, stages, split-K")  # fmt: skip
    results = []
    for name in args.shapes:
        for m in args.ms:
            results.append(run_case(name, m, args.reps, args.grid, device))
            if args.details:
                print(details(results[-1]), flush=True)
    print()
    print(summary(results, copy_bps))
    print("\nfastest settings as kernels/gemm/skinny_config.py table rows (M, N, K, config):")
    print(table_rows(results))
    print(f"\nswept in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
