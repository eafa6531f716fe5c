"""FP8 KV cache on the GPU (`--kv-cache-dtype fp8_e4m3`): graph replay equals eager decode per
backend, the compiled Triton kernels against the torch backend over the same FP8 blocks at a
llama3-8b layer's shape, the fused rotary + KV write byte-exact with the torch quantize, and
greedy agreement with bf16 KV. Skipped without CUDA."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from kernels.attention import TorchAttentionBackend, kv_quant
from kernels.fused import reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available"),
]
sys.path.insert(0, str(Path(__file__).parents[1] / "unit" / "kernels" / "attention"))
from attention_batch import make_batch  # noqa: E402

MODEL = "synthetic:smollm2-135m:layers=4"


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    lengths = torch.randint(3, 400, (14,), generator=gen).tolist()
    out = [torch.randint(100, 49152, (n,), generator=gen).tolist() for n in lengths]
    return out + [out[0][:300] + [7, 8, 9]]  # a prefix hit


def run(backend: str, kv_cache_dtype: str, enforce_eager: bool) -> list[list[int]]:
    llm = LLM(MODEL, device="cuda", dtype="bfloat16", attention_backend=backend,
              enforce_eager=enforce_eager, max_num_seqs=8, max_model_len=1024,
              kv_cache_dtype=kv_cache_dtype, num_blocks=200)  # fmt: skip
    assert llm.engine.pool.buffer.dtype == (
        torch.float8_e4m3fn if kv_cache_dtype == "fp8_e4m3" else torch.bfloat16
    )
    graphs = llm.engine.runner.decode_graphs
    assert graphs is not None and graphs.captured == (not enforce_eager)
    params = [SamplingParams(temperature=0.0, max_tokens=5 + 4 * (i % 6), ignore_eos=True)
              for i in range(len(prompts()))]  # fmt: skip
    outs = llm.generate(prompts(), params)
    llm.engine.check_no_leaks()
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_fp8_graph_replay_equals_eager(backend: str) -> None:
    assert run(backend, "fp8_e4m3", False) == run(backend, "fp8_e4m3", True)


def test_fp8_tokens_mostly_agree_with_bf16_kv() -> None:
    fp8, bf16 = run("triton", "fp8_e4m3", False), run("triton", "auto", False)
    same = sum(a == b for x, y in zip(fp8, bf16) for a, b in zip(x, y))
    total = sum(map(len, bf16))
    assert same / total > 0.5, (same, total)  # (random weights: near-ties are common)


@pytest.mark.parametrize("partition_len", [None, 256])
def test_compiled_triton_reads_fp8_like_the_torch_backend(partition_len) -> None:
    from kernels.attention.triton_backend import TritonAttentionBackend

    batch = make_batch([1] * 16 + [300, 77], [4000 - 64 * i for i in range(16)] + [1000, 0], 16,
                       num_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
                       dtype=torch.bfloat16, device="cuda", seed=2)  # fmt: skip
    scales = (torch.rand(2, 8, device="cuda") + 0.5).contiguous()
    k_cache = kv_quant.quantize(batch.k_cache.flatten(0, 1), scales[0]).view(batch.k_cache.shape)
    v_cache = kv_quant.quantize(batch.v_cache.flatten(0, 1), scales[1]).view(batch.v_cache.shape)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    want = TorchAttentionBackend().forward(batch.q, batch.k, batch.v, k_ref, v_ref, batch.meta,
                                           batch.scale, kv_scales=scales)  # fmt: skip
    got = TritonAttentionBackend(partition_len).forward(
        batch.q, batch.k, batch.v, k_cache, v_cache, batch.meta, batch.scale, kv_scales=scales
    )
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(k_cache.view(torch.uint8), k_ref.view(torch.uint8))


def test_compiled_fused_write_is_byte_exact() -> None:
    from kernels.fused import triton_ops

    gen = torch.Generator(device="cuda").manual_seed(0)
    t, h, kvh, d = 64, 32, 8, 128
    q, k, v = (torch.randn(t, n, d, generator=gen, device="cuda", dtype=torch.bfloat16) * 8
               for n in (h, kvh, kvh))  # fmt: skip
    angles = torch.randn(t, 1, d // 2, generator=gen, device="cuda")
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    slots = torch.randperm(256, device="cuda")[:t]
    scales = (torch.rand(2, kvh, device="cuda") + 0.25).contiguous()
    caches = [torch.zeros(16, 16, kvh, d, dtype=torch.float8_e4m3fn, device="cuda")
              for _ in range(4)]  # fmt: skip
    reference.rotary_qk_write_kv(q.clone(), k.clone(), v, cos, sin, caches[0], caches[1], slots,
                                 scales)  # fmt: skip
    triton_ops.rotary_qk_write_kv(q.clone(), k.clone(), v, cos, sin, caches[2], caches[3], slots,
                                  scales)  # fmt: skip
    assert torch.equal(caches[2].view(torch.uint8), caches[0].view(torch.uint8))
    assert torch.equal(caches[3].view(torch.uint8), caches[1].view(torch.uint8))
