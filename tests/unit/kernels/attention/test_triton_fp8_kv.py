"""FP8 KV cache in the Triton paged attention (FP8 tiles read as bf16, the per-head scales
folded around the kernels) and in the fused rotary + KV write, against the torch backend and
the torch quantize; on CPU through the Triton interpreter (tests/gpu runs the compiled ones).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from attention_batch import make_batch


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(".")[:2])


if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated (imported)
triton = pytest.importorskip(
    "triton", reason="triton is not installed (pip install --no-deps 'triton>=3.7')"
)
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
if INTERPRETING and _version(triton.__version__) < (3, 7) and _version(np.__version__) >= (2, 4):
    # Older interpreters call int() on 1-element arrays, which numpy >= 2.4 refuses.
    pytest.skip(
        f"the triton {triton.__version__} interpreter needs numpy < 2.4; "
        "pip install --no-deps 'triton>=3.7'",
        allow_module_level=True,
    )

from kernels.attention import TorchAttentionBackend, kv_quant  # noqa: E402
from kernels.attention.triton_backend import TritonAttentionBackend  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MIXED = ([1, 1, 1, 70, 1, 9], [0, 45, 100, 30, 64, 0], 3, 1)  # decodes first, then prefills
# a speculative verify batch: 5 queries per decode (K = 4 drafts), causal among them, then prefills
VERIFY = ([5, 5, 5, 9, 1], [0, 28, 300, 12, 20], 3, 5)


def fp8_caches(batch, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    def one(cache: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return kv_quant.quantize(cache.flatten(0, 1), scale).view(cache.shape)

    return one(batch.k_cache, scales[0]), one(batch.v_cache, scales[1])


# (bf16 on the GPU only: the interpreter's bf16 dot is not torch's)
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16] + [torch.bfloat16] * (not INTERPRETING)
)
@pytest.mark.parametrize("partition_len", [64, 4096], ids=["split", "one-split"])
@pytest.mark.parametrize("shape", [MIXED, VERIFY], ids=["mixed", "verify"])
def test_triton_reads_fp8_blocks_like_the_torch_backend(dtype, partition_len, shape) -> None:
    query_lens, context_lens, num_decodes, decode_query_len = shape
    batch = make_batch(
        query_lens, context_lens, num_decodes, num_heads=8, num_kv_heads=2, head_dim=32,
        block_size=16, dtype=dtype, device=DEVICE, seed=9, decode_query_len=decode_query_len,
    )  # fmt: skip
    scales = torch.tensor([[0.5, 2.0], [1.0, 0.25]], device=DEVICE)
    k_cache, v_cache = fp8_caches(batch, scales)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    expected = TorchAttentionBackend().forward(
        batch.q, batch.k, batch.v, k_ref, v_ref, batch.meta, batch.scale, kv_scales=scales
    )
    out = TritonAttentionBackend(partition_len).forward(
        batch.q, batch.k, batch.v, k_cache, v_cache, batch.meta, batch.scale, kv_scales=scales
    )
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)
    # both wrote the same FP8 bytes
    assert torch.equal(k_cache.view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), v_ref.view(torch.uint8))


def test_fused_rotary_write_quantizes_like_the_reference() -> None:
    from kernels.fused import reference, triton_ops

    gen = torch.Generator().manual_seed(0)
    t, h, kvh, d = 5, 4, 2, 16
    q, k, v = (torch.randn(t, n, d, generator=gen).to(DEVICE) for n in (h, kvh, kvh))
    angles = torch.randn(t, 1, d // 2, generator=gen).to(DEVICE)
    cos, sin = angles.cos(), angles.sin()
    slots = torch.tensor([3, 0, 9, 14, 6], device=DEVICE)
    scales = torch.tensor([[0.5, 2.0], [1.0, 0.25]], device=DEVICE)
    caches = [torch.zeros(2, 8, kvh, d, dtype=torch.float8_e4m3fn, device=DEVICE) for _ in range(4)]
    reference.rotary_qk_write_kv(q.clone(), k.clone(), v, cos, sin, caches[0], caches[1], slots,
                                 scales)  # fmt: skip
    triton_ops.rotary_qk_write_kv(q.clone(), k.clone(), v, cos, sin, caches[2], caches[3], slots,
                                  scales)  # fmt: skip
    for want, got in ((caches[0], caches[2]), (caches[1], caches[3])):
        assert want.float().abs().sum() > 0
        differ = want.view(torch.uint8) != got.view(torch.uint8)
        if not INTERPRETING:  # the compiled kernel rounds as torch does: byte-exact
            assert not differ.any()
            continue
        # The interpreter's fp32 -> e4m3 drops the carry of a mantissa rounded up into the
        # exponent (-1.98 -> -1.0, not -2.0) and rounds subnormals (< 2^-6) its own way: it
        # differs only where torch's value is a power of two or subnormal (tests/gpu checks
        # the bytes).
        values = want.float()[differ].abs()
        assert differ.float().mean() < 0.1
        power_of_two = values == torch.exp2(torch.log2(values).round())
        assert (power_of_two | (values < 2**-6)).all()


COMPILE_SCRIPT = """
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from kernels.attention import triton_paged_attention as t

consts = {"NUM_QUERIES_PER_KV": 4, "BLOCK_SIZE": 16, "HEAD_DIM": 128, "HEAD_DIM_PAD": 128,
          "BLOCK_N": 64, "DOT_PRECISION": "tf32"}
ints = {n: "i32" for n in ("partition_len", "min_partition_len", "stride_q_token",
        "stride_q_head", "stride_out_token", "stride_out_head", "stride_cache_block",
        "stride_cache_token", "stride_cache_head", "stride_block_table")}
sig = {"out_ptr": "*bf16", "partial_out_ptr": "*fp32", "partial_lse_ptr": "*fp32",
       "q_ptr": "*bf16", "k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv",
       "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "scale_log2": "fp32", **ints}
for query_len, block_g in ((1, 16), (5, 32)):  # a plain decode, a verify of 4 drafts
    compile(ASTSource(fn=t.paged_decode_kernel, signature=sig, constexprs={**consts,
            "SINGLE_SPLIT": False, "QUERY_LEN": query_len, "BLOCK_G": block_g, "USE_PDL": True}),
            target=GPUTarget("cuda", 90, 32))
print("ok")
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests/gpu runs the compiled kernels")
def test_the_decode_kernel_compiles_over_fp8_blocks_for_hopper() -> None:
    """The interpreter runs Python semantics; the compiler is stricter. The decode kernel over
    FP8 caches (one query per request, and a verify's five) compiled to an sm_90 cubin (Triton's bundled ptxas), no GPU needed."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT], env=env, capture_output=True,
                          text=True, timeout=240)  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
