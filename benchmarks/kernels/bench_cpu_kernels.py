"""The CPU bf16 fast paths against what they replace, on the default model's shapes.

    python -m benchmarks.kernels.bench_cpu_kernels [--rounds 3] [--skip-engine]

1. projections: the 30 layers' QKV, o_proj, gate_up, down and the LM head at 1 / 20 / 32 rows,
   F.linear vs weights packed once for oneDNN (kernels/gemm/cpu_packed.py), each layer's own
   weights (read from memory as in a step), beside the copy bandwidth measured here.
2. decode attention of 20 rows of 150-380 tokens (one layer): gather + SDPA vs the C++ kernel
   (kernels/attention/cpu_paged_decode.py).
3. the engine on bench_offline's 32-request workload (no prefix cache), output tokens/s with
   neither, the packed projections, and both; rounds alternate the three engines.
Medians of alternating rounds: this machine is shared and its speed drifts.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels.attention import cpu_paged_decode
from kernels.gemm import cpu_packed

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB, LAYERS = 576, 9, 3, 64, 1536, 49152, 30
DT = torch.bfloat16


def median_us(fns: dict[str, Callable[[], object]], rounds: int, reps: int) -> dict[str, float]:
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(reps):
                fn()
            times[name].append((time.perf_counter() - start) / reps * 1e6)
    return {name: statistics.median(t) for name, t in times.items()}


def copy_gbps() -> float:
    src = torch.empty(256 * 2**20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    best = min(median_us({"copy": lambda: dst.copy_(src)}, 3, 3).values())
    return 2 * src.numel() / best / 1e3  # read + write


def projections(rounds: int, num_layers: int = LAYERS) -> None:
    if not cpu_packed.supported(torch.device("cpu"), DT):
        print("\n1. projections: skipped, this CPU has no bf16 instructions (no packed GEMM)")
        return
    shapes = [(HEADS * HEAD_DIM + 2 * KV_HEADS * HEAD_DIM, HIDDEN), (HIDDEN, HIDDEN),
              (2 * INTER, HIDDEN), (HIDDEN, INTER)]  # fmt: skip
    layers = [[torch.randn(n, k).to(DT) for n, k in shapes] for _ in range(num_layers)]
    head = torch.randn(VOCAB, HIDDEN).to(DT)
    weights = [w for layer in layers for w in layer] + [head]
    packed = [cpu_packed.pack(w) for w in weights]
    total_bytes = sum(w.numel() * w.element_size() for w in weights)
    bandwidth = copy_gbps()
    floor_ms = total_bytes / bandwidth / 1e6  # the GPU tables' convention: bytes / copy rate
    print(f"\n1. projections of {num_layers} layers + LM head: {total_bytes / 1e6:.0f} MB of "
          f"bf16 weights; copy {bandwidth:.1f} GB/s (read+write) -> floor {floor_ms:.1f} ms")  # fmt: skip
    print(f"{'rows':>5} {'F.linear ms':>12} {'packed ms':>10} {'packed/F.linear':>16} "
          f"{'packed/floor':>13}")  # fmt: skip
    for rows in (1, 20, 32):
        xs = {k: torch.randn(rows, k).to(DT) for k in (HIDDEN, INTER)}
        result = median_us(_projection_calls(xs, weights, packed), rounds, reps=3)
        plain, fast = result["plain"] / 1e3, result["packed"] / 1e3
        print(f"{rows:>5} {plain:>12.1f} {fast:>10.1f} {fast / plain:>15.2f}x "
              f"{fast / floor_ms:>12.2f}x")  # fmt: skip


def _projection_calls(
    xs: dict[int, torch.Tensor], weights: list[torch.Tensor], packed: list[torch.Tensor]
) -> dict[str, Callable[[], object]]:
    """Every projection of `xs` (rows by input width) through F.linear, and packed."""
    return {
        "plain": lambda: [F.linear(xs[w.shape[1]], w) for w in weights],
        "packed": lambda: [
            cpu_packed.linear(xs[w.shape[1]], p, None) for w, p in zip(weights, packed)
        ],
    }


def decode_attention(rounds: int) -> None:
    gen = torch.Generator().manual_seed(0)
    rows, block_size, num_blocks = 20, 16, 6000
    k_cache = torch.randn(num_blocks, block_size, KV_HEADS, HEAD_DIM, generator=gen).to(DT)
    v_cache = torch.randn(num_blocks, block_size, KV_HEADS, HEAD_DIM, generator=gen).to(DT)
    lens = torch.randint(150, 381, (rows,), generator=gen)
    max_len = int(lens.max())
    blocks_per_row = -(-max_len // block_size)
    tables = torch.randperm(num_blocks, generator=gen)[: rows * blocks_per_row]
    tables = tables.view(rows, blocks_per_row)
    q = torch.randn(rows, HEADS, HEAD_DIM, generator=gen).to(DT)
    mask = (torch.arange(max_len) < lens[:, None])[:, None, None, :]
    scale = HEAD_DIM**-0.5

    def gather_sdpa() -> torch.Tensor:
        def gather(cache: torch.Tensor) -> torch.Tensor:
            picked = cache.index_select(0, tables.reshape(-1))
            return picked.view(rows, -1, KV_HEADS, HEAD_DIM)[:, :max_len].transpose(1, 2)

        return F.scaled_dot_product_attention(
            q[:, :, None], gather(k_cache), gather(v_cache), attn_mask=mask, scale=scale,
            enable_gqa=True,
        )  # fmt: skip

    fns: dict[str, Callable[[], object]] = {"gather + SDPA": gather_sdpa}
    if cpu_paged_decode.available():
        tables32, lens32 = tables.int(), lens.int()
        fns["C++ kernel"] = lambda: cpu_paged_decode.paged_decode_attention(
            q, k_cache, v_cache, tables32, lens32, scale
        )
    kv_bytes = 2 * int(lens.sum()) * KV_HEADS * HEAD_DIM * 2
    print(f"\n2. decode attention, one layer: {rows} rows of {int(lens.min())}-{max_len} tokens, "
          f"{kv_bytes / 1e6:.1f} MB of K and V")  # fmt: skip
    for name, us in median_us(fns, rounds, reps=30).items():
        print(f"{name:>14}: {us:7.0f} us  ({kv_bytes / us / 1e3:5.1f} GB/s of K and V)")


def engine(rounds: int) -> None:
    from benchmarks.engine.bench_offline import mixed_workload
    from engine import LLM, SamplingParams

    configs = {"neither": ("0", "0"), "packed GEMM": ("1", "0"), "both": ("1", "1")}
    llms = {}
    for name, (packed, attention) in configs.items():
        os.environ["PDSERVE_CPU_PACKED_GEMM"], os.environ["PDSERVE_CPU_ATTENTION_KERNEL"] = (
            packed,
            attention,
        )
        llms[name] = LLM("smollm2-135m", device="cpu", dtype="bfloat16",
                         enable_prefix_caching=False)  # fmt: skip
    workload = mixed_workload(32, VOCAB)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in workload]
    rates: dict[str, list[float]] = {name: [] for name in llms}
    tokens: dict[str, list[list[int]]] = {}
    for _ in range(rounds):
        for name, llm in llms.items():
            start = time.perf_counter()
            outs = llm.generate([p for p, _ in workload], params)
            rates[name].append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start))
            tokens[name] = [o.token_ids for o in outs]
    print(f"\n3. engine, smollm2-135m bf16, 32 requests, output tok/s ({rounds} rounds in turn)")
    base = statistics.median(rates["neither"])
    for name, values in rates.items():
        med = statistics.median(values)
        runs = " ".join(f"{v:.1f}" for v in values)
        same = sum(a == b for a, b in zip(tokens[name], tokens["neither"]))
        print(f"{name:>12}: median {med:6.1f}  ({med / base:.2f}x)   rounds {runs}   "
              f"requests with neither's tokens {same}/{len(workload)}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip-engine", action="store_true")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, bf16 packed GEMM "
          f"supported: {cpu_packed.supported(torch.device('cpu'), DT)}, C++ decode kernel: "
          f"{cpu_paged_decode.available()}")  # fmt: skip
    with torch.inference_mode():
        projections(args.rounds)
        decode_attention(args.rounds)
        if not args.skip_engine:
            engine(args.rounds)


if __name__ == "__main__":
    main()
