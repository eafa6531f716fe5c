"""Paged attention microbenchmark: every available backend on one llama3-8b layer
(32 q heads, 8 kv heads, head_dim 128, bf16) on CUDA.

    python -m benchmarks.kernels.bench_attention [--backends torch,triton,flash_attn] [--iters 20]

Decode reports KV bytes read / time against the measured HBM copy rate; prefill reports causal
FLOPs (4 * head_dim * num_heads per visible query-key pair) / time against the measured bf16
matmul rate. Times are whole `forward` calls (cache write included): eager, back to back (which
includes Python launch overhead when it exceeds GPU time), and replayed from a CUDA graph (GPU
time alone; the achieved rate is computed from it). FA2 reads KV
at 3.8 TB/s (decode, batch 64, context 1K) and runs prefill at 225-290 TFLOP/s on an H200: the
figures the Triton kernels must meet.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from kernels.attention import AttentionMetadata, get_attention_backend
from kernels.attention.selector import unavailable_reason

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
DTYPE = torch.bfloat16
BLOCK_SIZE = {"torch": 16, "triton": 16, "flash_attn": 256}


@dataclass(frozen=True)
class Case:
    name: str
    query_lens: list[int]
    context_lens: list[int]  # tokens already cached
    num_decodes: int

    @property
    def is_decode(self) -> bool:
        return self.num_decodes == len(self.query_lens)


CASES = [
    Case("decode b64 ctx1K", [1] * 64, [1023] * 64, 64),
    Case("decode b16 ctx4K", [1] * 16, [4095] * 16, 16),
    Case("decode b128 ctx2K", [1] * 128, [2047] * 128, 128),
    Case("decode b1 ctx32K", [1], [32767], 1),
    Case("prefill 4x2K", [2048] * 4, [0] * 4, 0),
    Case("prefill 1x8K", [8192], [0], 0),
    Case("chunked 2x2K +6K cached", [2048] * 2, [6144] * 2, 0),
]


def make_meta(case: Case, block_size: int, device: torch.device) -> AttentionMetadata:
    """Random non-contiguous block ids; slots of the new tokens through the block table."""
    query_lens = torch.tensor(case.query_lens, device=device)
    seq_lens = query_lens + torch.tensor(case.context_lens, device=device)
    blocks_per_req = (seq_lens + block_size - 1) // block_size
    max_blocks = int(blocks_per_req.max())
    block_ids = torch.randperm(int(blocks_per_req.sum()), device=device, dtype=torch.int32)
    block_tables = torch.zeros(len(case.query_lens), max_blocks, dtype=torch.int32, device=device)
    used = torch.arange(max_blocks, device=device) < blocks_per_req[:, None]
    block_tables[used] = block_ids
    query_start_loc = torch.nn.functional.pad(query_lens.cumsum(0), (1, 0))
    num_tokens = int(query_lens.sum())
    req_idx = torch.repeat_interleave(torch.arange(len(case.query_lens), device=device), query_lens)
    positions = (seq_lens - query_lens)[req_idx] + torch.arange(num_tokens, device=device)
    positions -= query_start_loc[req_idx]
    slot_mapping = block_tables[req_idx, positions // block_size].long() * block_size
    seq_lens_cpu = tuple(q + c for q, c in zip(case.query_lens, case.context_lens))
    return AttentionMetadata(
        query_start_loc=query_start_loc.int(),
        seq_lens=seq_lens.int(),
        slot_mapping=slot_mapping + positions % block_size,
        block_tables=block_tables,
        max_query_len=max(case.query_lens),
        max_seq_len=max(seq_lens_cpu),
        num_decodes=case.num_decodes,
        query_lens_cpu=tuple(case.query_lens),
        seq_lens_cpu=seq_lens_cpu,
    )


def time_s(fn, iters: int) -> float:
    """Mean seconds per call of `fn` over `iters` back-to-back calls, after one warm-up."""
    fn()
    torch.cuda.synchronize()
    return _time_warm_s(fn, iters)


def time_graph_s(fn, iters: int) -> float:
    """Mean seconds per replay of a CUDA graph of `fn` (call `fn` once eagerly first), after
    one untimed replay (the first one uploads the graph)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    return _time_warm_s(graph.replay, iters)


def _time_warm_s(fn, iters: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def measure_ceilings() -> tuple[float, float]:
    """(HBM copy bytes/s counting read + write, bf16 8192^3 matmul FLOP/s) on this GPU."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_bps = 2 * src.numel() / time_s(lambda: dst.copy_(src), 20)
    a = torch.randn(8192, 8192, dtype=DTYPE, device="cuda")
    b = torch.randn_like(a)
    matmul_flops = 2 * 8192**3 / time_s(lambda: a @ b, 10)
    return copy_bps, matmul_flops


def run_case(backend_name: str, case: Case, iters: int) -> tuple[float, float, float]:
    """(eager seconds, CUDA-graph seconds per forward, KV bytes read or causal FLOPs)."""
    device = torch.device("cuda")
    block_size = BLOCK_SIZE[backend_name]
    backend = get_attention_backend(backend_name, device, DTYPE, block_size)
    meta = make_meta(case, block_size, device)
    num_blocks = int(meta.block_tables.max()) + 1
    k_cache = torch.randn(
        num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE, device=device
    )
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(meta.num_tokens, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
    k = torch.randn(meta.num_tokens, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
    v = torch.randn_like(k)

    def forward() -> torch.Tensor:
        return backend.forward(q, k, v, k_cache, v_cache, meta, HEAD_DIM**-0.5)

    eager_s = time_s(forward, iters)
    try:
        graph_s = time_graph_s(forward, iters)
    except RuntimeError as exc:  # a backend that cannot be captured: report eager time
        print(f"{backend_name}: CUDA graph capture failed ({exc}); using eager time")
        graph_s = eager_s
    if case.is_decode:
        work = sum(meta.seq_lens_cpu) * NUM_KV_HEADS * HEAD_DIM * 2 * DTYPE.itemsize
    else:
        pairs = sum(q_len * c + q_len * (q_len + 1) // 2
                    for q_len, c in zip(case.query_lens, case.context_lens))  # fmt: skip
        work = 4 * HEAD_DIM * NUM_HEADS * pairs
    return eager_s, graph_s, work


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", default="torch,triton,flash_attn")
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_attention needs a CUDA device")
    device = torch.device("cuda")
    backends = []
    for name in args.backends.split(","):
        reason = unavailable_reason(name, device, DTYPE, BLOCK_SIZE[name])
        if reason is None:
            backends.append(name)
        else:
            print(f"skipping {name}: {reason}")
    copy_bps, matmul_flops = measure_ceilings()
    print(f"{torch.cuda.get_device_name()}: HBM copy {copy_bps / 1e12:.2f} TB/s, "
          f"bf16 matmul {matmul_flops / 1e12:.0f} TFLOP/s (ceilings)")  # fmt: skip
    print(f"{'case':<26}{'backend':<12}{'block':>6}{'eager us':>10}{'graph us':>10}"
          f"{'achieved':>16}{'of ceiling':>12}")  # fmt: skip
    for case in CASES:
        for name in backends:
            eager_s, graph_s, work = run_case(name, case, args.iters)
            unit, ceiling = ("TB/s", copy_bps) if case.is_decode else ("TFLOP/s", matmul_flops)
            rate = work / graph_s
            print(f"{case.name:<26}{name:<12}{BLOCK_SIZE[name]:>6}{eager_s * 1e6:>10.1f}"
                  f"{graph_s * 1e6:>10.1f}{rate / 1e12:>11.2f} {unit:<7}{rate / ceiling:>9.0%}")  # fmt: skip
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
