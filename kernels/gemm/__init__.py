"""Dense GEMMs for few tokens: the skinny GEMM (`skinny_gemm.py`, Triton; imported on use since
triton is optional), its launch table (`skinny_config.py`), which projections take it
(`skinny_routing.py`), and bf16 projections on packed weights on CPU (`cpu_packed.py`)."""

from kernels.gemm.skinny_config import MAX_M, SkinnyGemmConfig, skinny_gemm_config

__all__ = ["MAX_M", "SkinnyGemmConfig", "skinny_gemm_config"]
