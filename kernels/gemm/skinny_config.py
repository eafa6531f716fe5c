"""`SkinnyGemmConfig`: the skinny GEMM's launch (tile, warps, stages), and the heuristic table
that picks one from (M, N, K) on the host with no device query, no timing and no sync (CUDA
graphs capture the same launch every time).

```
rows of _TABLE, first match wins:  M <= max_m  and  N <= max_n  and  K <= max_k
  M == 1      one token:  no tl.dot, a multiply-add into a [BLOCK_N, 1, BLOCK_K] fp32 tile
              summed over K once at the end (any M within its register budget when asked)
  M <= 128    tl.dot on W [BLOCK_N, BLOCK_K] x x^T [BLOCK_K, BLOCK_M], M padded to 16
  N           picks BLOCK_N: enough N tiles to fill an H200's 132 SMs about twice (no split-K)
```

Starting guesses from the tile arithmetic, not measured: about 2 programs per SM for 4096-row W,
3-4 pipeline stages of 8-32 KiB of W each, shared memory <= ~100 KiB per program so that two
fit on an SM (the wgmma tiles, BLOCK_N >= 64, take num_stages buffers, the mma.sync ones
num_stages - 1; compiled offline for sm_90: 34-120 registers, no spills). To be replaced by
`python -m benchmarks.kernels.gemm_sweep`'s fastest setting per (M, shape) measured on the H200: it
prints them as rows of this table, sorted so that first-match picks each swept (M, N, K)'s own
row (and an M between two swept ones the larger one's); keep the catch-all rows (max_n and
max_k unbounded) last.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_M = 128  # the largest M (tokens) the kernel is meant for; above it use cuBLAS
MIN_DOT_M = 16  # tl.dot needs every dim >= 16: M is padded to 16 on the dot path
MAX_SPLIT_K = 16  # the reduce launch sums split_k fp32 partials per output, unrolled
_MAX_SMEM_BYTES = 200 * 1024  # of an H100/H200 SM's 227 KiB, headroom for the epilogue
_MAX_GEMV_REGS = 64  # fp32 accumulator registers per thread on the no-dot path


@dataclass(frozen=True)
class SkinnyGemmConfig:
    """One launch of the skinny GEMM: a program computes a [block_m, block_n] tile of y over
    its share of K, block_k at a time. split_k == 1: the whole of K (every output has one
    program, one order, no second launch); split_k > 1: K in split_k equal runs of whole
    block_k steps, each program's fp32 partial tile to a workspace that a reduce launch sums
    in split order (more programs where the N tiles alone leave SMs idle; still bitwise
    deterministic)."""

    block_n: int  # rows of W (outputs) per program
    block_k: int  # K step
    num_warps: int
    num_stages: int  # software pipeline depth of the W/x loads
    block_m: int = 16  # the M tile's cap (tokens per program); M is padded to a power of two
    use_dot: bool = True  # tl.dot (M padded to >= 16) or a multiply-add reduction
    split_k: int = 1  # programs per output tile along K (1: no split, no reduce launch)

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k", "block_m"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"SkinnyGemmConfig.{name} must be a power of two, got {value}")
        if self.use_dot and min(self.block_n, self.block_k, self.block_m) < MIN_DOT_M:
            raise ValueError(
                f"tl.dot needs block_n, block_k and block_m >= {MIN_DOT_M}: {self.label()}"
            )
        if self.num_warps not in (1, 2, 4, 8, 16) or self.num_stages < 1:
            raise ValueError(f"bad num_warps/num_stages: {self.label()}")
        if not 1 <= self.split_k <= MAX_SPLIT_K:
            raise ValueError(f"split_k must be in 1..{MAX_SPLIT_K}: {self.label()}")

    def tile_m(self, m: int) -> int:
        """BLOCK_M for M tokens: M rounded up to a power of two (16 at least with tl.dot),
        capped at block_m (more M tiles then)."""
        padded = 1 << max(m - 1, 0).bit_length()
        return min(self.block_m, max(padded, MIN_DOT_M if self.use_dot else 1))

    def num_programs(self, m: int, n: int) -> int:
        return -(-m // self.tile_m(m)) * -(-n // self.block_n) * self.split_k

    def k_per_split(self, k: int) -> int:
        """The K run of one split: whole block_k steps, the last run the shorter."""
        steps = -(-k // self.block_k)
        return -(-steps // self.split_k) * self.block_k

    def smem_bytes(self, m: int, itemsize: int) -> int:
        """Shared memory of the pipelined W and x tiles (what num_stages multiplies)."""
        return self.num_stages * (self.block_n + self.tile_m(m)) * self.block_k * itemsize

    def fits(self, m: int, itemsize: int = 2) -> bool:
        """Within shared memory (and, without tl.dot, the accumulator's register budget)."""
        if self.smem_bytes(m, itemsize) > _MAX_SMEM_BYTES:
            return False
        if self.use_dot:
            return True
        acc = self.block_n * self.tile_m(m) * self.block_k
        return acc <= _MAX_GEMV_REGS * 32 * self.num_warps

    def label(self) -> str:
        kind = "dot" if self.use_dot else "fma"
        split = f" split{self.split_k}" if self.split_k > 1 else ""
        return (
            f"{kind} N{self.block_n} K{self.block_k} M{self.block_m} "
            f"w{self.num_warps} s{self.num_stages}{split}"
        )


_INF = 1 << 62
# (max_m, max_n, max_k, config): first match wins. N <= 8192: QKV 6144, o_proj/down 4096;
# N <= 32768: gate_up 28672; above: lm_head 128256 (llama3-8b shapes).
_TABLE: tuple[tuple[int, int, int, SkinnyGemmConfig], ...] = (
    (1, 8192, _INF, SkinnyGemmConfig(16, 256, 4, 4, block_m=1, use_dot=False)),
    (1, 32768, _INF, SkinnyGemmConfig(32, 256, 4, 4, block_m=1, use_dot=False)),
    (1, _INF, _INF, SkinnyGemmConfig(64, 128, 4, 4, block_m=1, use_dot=False)),
    (16, 8192, _INF, SkinnyGemmConfig(16, 256, 4, 4)),
    (16, 32768, _INF, SkinnyGemmConfig(64, 128, 4, 4)),
    (16, _INF, _INF, SkinnyGemmConfig(128, 64, 4, 4)),
    (32, 8192, _INF, SkinnyGemmConfig(16, 256, 4, 4, block_m=32)),
    (32, 32768, _INF, SkinnyGemmConfig(64, 128, 4, 4, block_m=32)),
    (32, _INF, _INF, SkinnyGemmConfig(128, 64, 4, 4, block_m=32)),
    (64, 8192, _INF, SkinnyGemmConfig(32, 128, 4, 4, block_m=64)),
    (64, 32768, _INF, SkinnyGemmConfig(64, 128, 4, 3, block_m=64)),
    (64, _INF, _INF, SkinnyGemmConfig(128, 64, 4, 4, block_m=64)),
    (MAX_M, 8192, _INF, SkinnyGemmConfig(64, 64, 4, 4, block_m=64)),
    (MAX_M, 32768, _INF, SkinnyGemmConfig(128, 64, 8, 4, block_m=128)),
    (MAX_M, _INF, _INF, SkinnyGemmConfig(128, 64, 8, 4, block_m=128)),
)


# Where the skinny GEMM measured faster than cuBLAS (F.linear) on an H200, both replayed from a
# CUDA graph, by >= 3% (benchmarks/results/2026-12-02-h200-gemm-sweep.txt: `python -m
# benchmarks.kernels.gemm_sweep --ms 1,8,32,128`, HBM copy 4.11 TB/s in that run), AND in the engine:
# (M, N, K) -> the fastest launch swept, with cuBLAS us -> ours. The sweep's wins at 8 and 32
# tokens (LM head, gate_up) made `pd-bench engine` slower (b8 4.920 -> 5.063 ms, b32 5.818 ->
# 5.916; one token 4.626 -> 4.568): only the one-token rows are kept. Every other shape and M
# stays on cuBLAS (routed_linear): a win is taken only where one was measured.
MEASURED_WINS: dict[tuple[int, int, int], SkinnyGemmConfig] = {
    # llama3-8b, one token: QKV 15.6 -> 15.0 us, o_proj 12.6 -> 10.7, down 31.7 -> 30.1,
    # LM head 249.9 -> 237.0 (cuBLAS splits K for o_proj and down and adds a reduce kernel)
    (1, 6144, 4096): SkinnyGemmConfig(16, 256, 4, 4, block_m=1, use_dot=False),
    (1, 4096, 4096): SkinnyGemmConfig(8, 512, 4, 3, block_m=1, use_dot=False),
    (1, 4096, 14336): SkinnyGemmConfig(8, 512, 4, 3, block_m=1, use_dot=False),
    (1, 128256, 4096): SkinnyGemmConfig(64, 128, 4, 4, block_m=128),
    # 32 tokens, o_proj split over K in 4 (64 N tiles x 4 = 256 programs): 13.2 -> 12.6 us,
    # and in the engine b32 5.962 / 5.966 -> 5.918 / 5.911 ms (A/B twice in one process,
    # benchmarks/results/2026-12-04-h200-split-k.txt); the other split wins were < 3%
    (32, 4096, 4096): SkinnyGemmConfig(64, 128, 4, 3, block_m=128, split_k=4),
}


# Where the skinny GEMM wins only inside a chain of PDL launches (kernels/pdl.py): cuBLAS is
# launched plainly and makes the next kernel wait for all of it, the skinny GEMM keeps the step's
# kernels overlapping. Rows (max_m, N, K, launch): a launch of M tokens takes the first row with
# M <= max_m of its (N, K) (llama3-8b's shapes). The launches are the sweeps' fastest at 8 or 32
# tokens (2026-12-02-h200-gemm-sweep.txt, 2026-12-04-h200-split-k.txt: 0.88-1.01x of cuBLAS
# alone), reused unswept at 16 and 64 tokens and for down at 8 (the 32-token split-K launch);
# each row was measured only in the engine, as a whole step. In the engine on
# an H100 with PDL (benchmarks/results/2026-12-05-h100-pdl.txt), ms a step: b8 6.48 -> 6.15 and
# b16 7.06 -> 6.73 (the 8- and 16-token rows), b32 7.80 -> 7.67, b64 9.44 -> 9.38; with PDL off
# (PDSERVE_PDL=0) these stay on cuBLAS.
CHAIN_WINS: tuple[tuple[int, int, int, SkinnyGemmConfig], ...] = (
    (8, 6144, 4096, SkinnyGemmConfig(64, 128, 4, 4, block_m=128)),
    (8, 28672, 4096, SkinnyGemmConfig(128, 128, 4, 3, block_m=128)),
    (8, 4096, 4096, SkinnyGemmConfig(32, 256, 4, 4, block_m=128)),
    (8, 4096, 14336, SkinnyGemmConfig(64, 128, 4, 3, block_m=128, split_k=4)),
    (16, 6144, 4096, SkinnyGemmConfig(64, 128, 4, 4, block_m=128)),
    (16, 28672, 4096, SkinnyGemmConfig(64, 64, 4, 3, block_m=128)),
    (16, 4096, 14336, SkinnyGemmConfig(64, 128, 4, 3, block_m=128, split_k=4)),
    (32, 6144, 4096, SkinnyGemmConfig(64, 128, 4, 4, block_m=128)),
    (32, 28672, 4096, SkinnyGemmConfig(64, 64, 4, 3, block_m=128)),
    (32, 4096, 14336, SkinnyGemmConfig(64, 128, 4, 3, block_m=128, split_k=4)),
    (64, 6144, 4096, SkinnyGemmConfig(64, 128, 4, 4, block_m=128)),
    (64, 28672, 4096, SkinnyGemmConfig(64, 64, 4, 3, block_m=128)),
)


def chain_win(m: int, n: int, k: int) -> SkinnyGemmConfig | None:
    """CHAIN_WINS' launch for M tokens of this (N, K): its first row with M <= max_m."""
    for max_m, row_n, row_k, config in CHAIN_WINS:
        if m <= max_m and (n, k) == (row_n, row_k):
            return config
    return None


def measured_win(m: int, n: int, k: int, chained: bool = False) -> SkinnyGemmConfig | None:
    """The launch that beat cuBLAS for exactly this (M, N, K) when measured, else None;
    `chained`: launched with PDL, where CHAIN_WINS count too."""
    win = MEASURED_WINS.get((m, n, k))
    return chain_win(m, n, k) if win is None and chained else win


# Launches for the fused prologues (the RMSNorm of a QKV or gate_up input, the SwiGLU of a down
# projection's) where the plain GEMM is not a measured win but the fusion saves a launch:
# llama3-8b's one-token gate_up on the multiply-add path (the table's launch; the sweep's
# fastest, a tl.dot one, puts the normed x tile through shared memory a second time). In the
# engine, b1 (benchmarks/results/2026-12-03-h200-fused-prologues.txt): 4.570 ms/step unfused,
# 4.47 with the SwiGLU fused, 4.41 with the norms fused too (gate_up on tl.dot: no better than
# cuBLAS + the norm kernel, 4.415), 4.34 with this launch and the squares summed once.
_FUSED_ONLY: dict[tuple[int, int, int], SkinnyGemmConfig] = {
    (1, 28672, 4096): SkinnyGemmConfig(32, 256, 4, 4, block_m=1, use_dot=False),
}


def fused_config(m: int, n: int, k: int) -> SkinnyGemmConfig | None:
    """The launch for a GEMM with a fused prologue at exactly (M, N, K), else None."""
    return measured_win(m, n, k) or _FUSED_ONLY.get((m, n, k))


def skinny_gemm_config(m: int, n: int, k: int) -> SkinnyGemmConfig:
    """The table's launch for y[M, N] = x[M, K] @ W[N, K]^T (1 <= M <= MAX_M)."""
    if not 1 <= m <= MAX_M:
        raise ValueError(f"the skinny GEMM takes 1 <= M <= {MAX_M} tokens, got M={m}")
    for max_m, max_n, max_k, config in _TABLE:
        if m <= max_m and n <= max_n and k <= max_k:
            return config
    raise AssertionError("the table's last rows match every shape")  # unreachable
