"""Kernel benchmarks and launch sweeps: attention, the skinny GEMM, the CPU bf16 fast paths."""
