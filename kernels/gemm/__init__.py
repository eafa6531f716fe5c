"""Dense GEMMs for few tokens: the skinny GEMM (`skinny_gemm.py`, Triton; imported on use since
triton is optional) and its launch table (`skinny_config.py`)."""

from kernels.gemm.skinny_config import MAX_M, SkinnyGemmConfig, skinny_gemm_config

__all__ = ["MAX_M", "SkinnyGemmConfig", "skinny_gemm_config"]
