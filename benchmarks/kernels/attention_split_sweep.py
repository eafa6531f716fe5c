"""Decode split sweep: launch settings of the Triton paged decode kernel on one llama3-8b layer
(32 q heads, 8 kv heads, head_dim 128, bf16, KV block size 16), CUDA only.

    python3 -m benchmarks.kernels.attention_split_sweep [--batches 1,8,32,128] [--contexts 1024,4096]

For each (batch, context), every request at that context, it times the Triton backend's decode
`forward` replayed from a CUDA graph (the cache write left out, `kv_written=True`: it is the
same for every setting) under a grid of `DecodeLaunchConfig`s (min partition P, max splits S,
BLOCK_N N, warps w, stages s) and prints one markdown table: microseconds per call, KV bytes
read per second, that rate over the HBM copy rate measured in the same run (read + write
counted, benchmarks/engine/ceilings.py), the largest error against the torch reference, and
the fastest correct setting marked. The grid, two phases per table:

```
policies  `default` (256-key slices, 16 at most: the policy before decode_splits) and
          `heuristic` (decode_launch_config for this batch size and GPU; one row if the same)
slices    1, 2, 4, ... 64 slices per request at this context (P = context / slices, S = slices),
          BLOCK_N 64, 4 warps, 3 stages (the bf16 tile; BLOCK_N 32 for 32-key slices)
tiles     the fastest slicing of phase 1 with BLOCK_N 32/64/128 x 2/4/8 warps
```

A small layer's KV fits in the L2 cache (50 MiB on an H100/H200) and a model reads a different
layer's KV each call, so each graph replays the forward over enough copies of the cache to
read ROTATE_BYTES (at most MAX_COPIES copies), and the time per call is the replay time over
the copies. A last table compares the default policy, the heuristic and the fastest setting.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from dataclasses import dataclass

import torch

from benchmarks.engine.ceilings import memory_bandwidth
from benchmarks.kernels.bench_attention import (
    DTYPE,
    HEAD_DIM,
    NUM_HEADS,
    NUM_KV_HEADS,
    Case,
    make_meta,
    time_graph_s,
)
from kernels.attention import AttentionMetadata, TorchAttentionBackend
from kernels.attention.decode_launch_config import (
    MAX_SPLITS,
    DecodeLaunchConfig,
    decode_launch_config,
    default_policy_config,
)

BLOCK_SIZE = 16
ROTATE_BYTES = 256 << 20  # KV read per replay at least (several times the L2 cache)
MAX_COPIES = 64
TOLERANCE = 2e-2  # bf16, as tests/gpu/test_attention_gpu.py
TILES = [(32, 2), (32, 4), (32, 8), (64, 2), (64, 4), (64, 8), (128, 2), (128, 4), (128, 8)]


@dataclass(frozen=True)
class Row:
    policy: str  # "default", "heuristic" or ""
    config: DecodeLaunchConfig
    time_s: float | None  # None: the setting failed (reason in `error`)
    max_err: float = 0.0
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.time_s is not None and self.max_err <= TOLERANCE

    @property
    def seconds(self) -> float:
        """`time_s` of a setting that ran (ValueError for one that failed)."""
        if self.time_s is None:
            raise ValueError(f"{self.policy or self.config.label()} failed: {self.error}")
        return self.time_s


def split_settings(batch: int, context: int, num_sms: int) -> list[tuple[str, DecodeLaunchConfig]]:
    """Phase 1: the two policies, then 1, 2, 4, ... slices per request at `context`, on the
    dtype's tile (or a 32-key tile for slices shorter than it), each launch once."""
    base = default_policy_config(DTYPE)
    heuristic = decode_launch_config(DTYPE, batch, NUM_KV_HEADS, num_sms)
    if heuristic == base:
        settings = [("default=heuristic", base)]
    else:
        settings = [("default", base), ("heuristic", heuristic)]
    num_slices = 1
    while num_slices <= MAX_SPLITS:
        config = dataclasses.replace(
            base, min_partition_len=-(-context // num_slices), max_splits=num_slices
        )
        if config.num_slices(context) != num_slices:
            config = dataclasses.replace(config, block_n=32)
        if config.num_slices(context) == num_slices and all(config != c for _, c in settings):
            settings.append(("", config))
        num_slices *= 2
    return settings


def tile_settings(best: DecodeLaunchConfig) -> list[tuple[str, DecodeLaunchConfig]]:
    """Phase 2: the best slicing with every other tile (2 stages for 128-key tiles, whose
    K and V tiles take 64 KiB of shared memory per stage)."""
    settings = []
    for block_n, num_warps in TILES:
        stages = 2 if block_n >= 128 else 3
        config = dataclasses.replace(best, block_n=block_n, num_warps=num_warps, num_stages=stages)
        if config != best:
            settings.append(("", config))
    return settings


@dataclass
class Layer:
    """One decode batch and `copies` copies of a layer's KV cache."""

    meta: AttentionMetadata
    q: torch.Tensor  # [batch, NUM_HEADS, HEAD_DIM]
    k: torch.Tensor  # [batch, NUM_KV_HEADS, HEAD_DIM] (unused: kv_written)
    caches: torch.Tensor  # [copies, 2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM]
    expected: torch.Tensor  # the torch reference's output over copy 0
    kv_bytes: int  # read per call

    @property
    def copies(self) -> int:
        return self.caches.shape[0]


def make_layer(batch: int, context: int, device: torch.device) -> Layer:
    case = Case(f"b{batch} ctx{context}", [1] * batch, [context - 1] * batch, batch)
    meta = dataclasses.replace(make_meta(case, BLOCK_SIZE, device), static_shapes=True)
    num_blocks = int(meta.block_tables.max()) + 1
    kv_bytes = batch * context * NUM_KV_HEADS * HEAD_DIM * 2 * DTYPE.itemsize
    copies = max(1, min(MAX_COPIES, -(-ROTATE_BYTES // kv_bytes)))
    caches = torch.randn(
        copies, 2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE, device=device
    )
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
    k = torch.randn(batch, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
    ref_meta = dataclasses.replace(meta, static_shapes=False)
    expected = TorchAttentionBackend().forward(
        q, k, k, caches[0, 0], caches[0, 1], ref_meta, HEAD_DIM**-0.5, kv_written=True
    )
    return Layer(meta, q, k, caches, expected, kv_bytes)


def time_setting(layer: Layer, policy: str, config: DecodeLaunchConfig, iters: int) -> Row:
    """One setting: an eager call checked against the reference, then graph replays."""
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources

    from kernels.attention.triton_backend import TritonAttentionBackend

    backend = TritonAttentionBackend(decode_config=config)

    def forward(copy: int) -> torch.Tensor:
        k_cache, v_cache = layer.caches[copy, 0], layer.caches[copy, 1]
        return backend.forward(layer.q, layer.k, layer.k, k_cache, v_cache, layer.meta,
                               HEAD_DIM**-0.5, kv_written=True)  # fmt: skip

    try:
        out = forward(0)
        torch.cuda.synchronize()
    except (OutOfResources, CompilationError) as exc:
        return Row(policy, config, None, error=f"{type(exc).__name__}: {exc}".splitlines()[0])
    max_err = (out.float() - layer.expected.float()).abs().max().item()
    replay_s = time_graph_s(lambda: [forward(c) for c in range(layer.copies)], iters)
    return Row(policy, config, replay_s / layer.copies, max_err)


def best_row(rows: list[Row]) -> Row | None:
    ok = [r for r in rows if r.ok]
    return min(ok, key=lambda r: r.seconds) if ok else None


def table(rows: list[Row], layer: Layer, context: int, copy_bps: float) -> str:
    """The markdown table of one (batch, context)."""
    best = best_row(rows)
    batch = layer.q.shape[0]
    lines = [
        "| setting | policy | slices | grid | us/call | GB/s | of copy | max err | |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for row in rows:
        config = row.config
        grid = batch * NUM_KV_HEADS * config.max_splits
        head = f"| {config.label()} | {row.policy} | {config.num_slices(context)} | {grid} |"
        if row.time_s is None:
            lines.append(f"{head} failed | | | | {row.error} |")
            continue
        rate = layer.kv_bytes / row.time_s
        mark = "**best**" if row is best else ("" if row.ok else "WRONG")
        lines.append(
            f"{head} {row.time_s * 1e6:.1f} | {rate / 1e9:.0f} | {rate / copy_bps:.0%} | "
            f"{row.max_err:.1e} | {mark} |"
        )
    return "\n".join(lines)


def sweep_case(
    batch: int, context: int, num_sms: int, iters: int, copy_bps: float, device: torch.device
) -> list[Row]:
    layer = make_layer(batch, context, device)
    rows = [time_setting(layer, p, c, iters) for p, c in split_settings(batch, context, num_sms)]
    best = best_row(rows)
    if best is not None:
        rows += [time_setting(layer, p, c, iters) for p, c in tile_settings(best.config)]
    print(f"\n### batch {batch}, context {context}: {layer.kv_bytes / 2**20:.0f} MiB of KV per "
          f"call, {layer.copies} cache copies per replay\n")  # fmt: skip
    print(table(rows, layer, context, copy_bps))
    del layer
    torch.cuda.empty_cache()
    return rows


def summary(results: dict[tuple[int, int], list[Row]]) -> str:
    """Per (batch, context): default, heuristic and fastest setting, us per call."""
    lines = [
        "| batch | context | default us | heuristic us | heuristic speedup | best | best us |",
        "| ---: | ---: | ---: | ---: | ---: | --- | ---: |",
    ]

    def us(row: Row | None) -> str:
        return "-" if row is None or not row.ok else f"{row.seconds * 1e6:.1f}"

    for (batch, context), rows in results.items():
        default = next((r for r in rows if "default" in r.policy), None)
        heuristic = next((r for r in rows if "heuristic" in r.policy), None)
        best = best_row(rows)
        speedup = "-"
        if default is not None and heuristic is not None and default.ok and heuristic.ok:
            speedup = f"{default.seconds / heuristic.seconds:.2f}x"
        best_label = "-" if best is None else best.config.label()
        lines.append(
            f"| {batch} | {context} | {us(default)} | {us(heuristic)} | {speedup} | "
            f"{best_label} | {us(best)} |"
        )
    return "\n".join(lines)


def parse_ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=parse_ints, default=[1, 8, 32, 128])
    parser.add_argument("--contexts", type=parse_ints, default=[1024, 4096])
    parser.add_argument("--iters", type=int, default=20, help="graph replays timed per setting")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("attention_split_sweep needs a CUDA device (none is visible)")
    start = time.perf_counter()
    device = torch.device("cuda")
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    copy_bps = memory_bandwidth(device, 1 << 30)
    print(f"{torch.cuda.get_device_name()}: {num_sms} SMs, HBM copy {copy_bps / 1e9:.0f} GB/s "
          f"(read + write; the ceiling); llama3-8b layer, bf16, KV block {BLOCK_SIZE}; "
          f"setting = P min partition, S max splits, N BLOCK_N, w warps, s stages")  # fmt: skip
    results = {}
    for batch in args.batches:
        for context in args.contexts:
            results[batch, context] = sweep_case(
                batch, context, num_sms, args.iters, copy_bps, device
            )
    print("\n### summary\n")
    print(summary(results))
    print(f"\nsweep took {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
