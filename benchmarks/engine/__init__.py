"""pd-bench engine, offline and profile: the engine in one process, against the roofline and
GEMM."""
