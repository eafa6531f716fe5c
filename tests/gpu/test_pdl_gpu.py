"""Programmatic dependent launch (kernels/pdl.py) changes when kernels start, never what they
compute: a chain of dependent kernels (each reads what the one before wrote) gives bitwise the
results of plain launches, eagerly and replayed from a CUDA graph, and the engine generates the
same tokens with PDSERVE_PDL=1 as without. Skipped without CUDA or on GPUs older than sm_90."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available"),
]


@pytest.fixture
def pdl():
    from kernels import pdl

    if not pdl.supported(torch.cuda.get_device_capability()):
        pytest.skip("programmatic dependent launch needs sm_90+ and a Triton that has it")
    yield pdl
    pdl.set_enabled(False, prefetch_bytes=16 * 1024)


def _layer_chain(m: int):
    """One llama3-8b-sized layer's kernels at m tokens, each on the last one's output."""
    from kernels.attention.triton_backend import paged_decode_attention
    from kernels.fused import triton_ops as ops
    from kernels.gemm import SkinnyGemmConfig
    from kernels.gemm.skinny_gemm import skinny_linear, skinny_norm_linear

    gen = torch.Generator(device="cuda").manual_seed(m)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(torch.bfloat16)

    hidden, heads, kv_heads, head_dim, block = 4096, 32, 8, 128, 16
    w_qkv, w_o = rand(6144, hidden, scale=0.02), rand(hidden, hidden, scale=0.02)
    w_gu, w_down = rand(2 * 1024, hidden, scale=0.02), rand(hidden, 1024, scale=0.03)
    norm_w = rand(hidden, scale=0.1) + 1
    k_cache, v_cache = (
        rand(m * 64, block, kv_heads, head_dim),
        rand(m * 64, block, kv_heads, head_dim),
    )
    block_tables = torch.arange(m * 64, device="cuda", dtype=torch.int32).view(m, 64)
    seq_lens = torch.full((m,), 700, device="cuda", dtype=torch.int32)
    slots = (block_tables[:, 43].long() * block + 11).contiguous()  # position 699
    cos, sin = rand(m, 1, head_dim // 2), rand(m, 1, head_dim // 2)
    split = SkinnyGemmConfig(64, 128, 4, 3, block_m=128, split_k=4)
    residual0, x0 = rand(m, hidden), rand(m, hidden)

    def chain() -> torch.Tensor:
        qkv, residual = skinny_norm_linear(x0, residual0.clone(), norm_w, 1e-5, w_qkv)
        q, k, v = qkv.split([4096, 1024, 1024], dim=-1)
        q, k = ops.rotary_qk_write_kv(
            q.view(m, heads, head_dim), k.view(m, kv_heads, head_dim),
            v.view(m, kv_heads, head_dim), cos, sin, k_cache, v_cache, slots,
        )  # fmt: skip
        attn = torch.empty_like(q)
        paged_decode_attention(attn, q, k_cache, v_cache, block_tables, seq_lens, m, 700,
                               head_dim**-0.5)  # fmt: skip
        out = skinny_linear(attn.view(m, hidden), w_o, config=split)
        normed, residual = ops.add_rms_norm(out, residual, norm_w, 1e-5)
        gate_up = skinny_linear(normed, w_gu)
        return skinny_linear(ops.silu_and_mul(gate_up), w_down) + residual

    return chain


@pytest.mark.parametrize("m", [2, 32, 64])
def test_a_dependent_chain_gives_the_plain_launches_results(pdl, m: int) -> None:
    chain = _layer_chain(m)
    pdl.set_enabled(False)
    want = chain()
    pdl.set_enabled(True, prefetch_bytes=64 * 1024)
    assert pdl.uses_pdl(m)
    for _ in range(3):
        assert torch.equal(chain(), want)
    graph = torch.cuda.CUDAGraph()
    chain()  # compiled before capture
    with torch.cuda.graph(graph):
        got = chain()
    for _ in range(3):
        got.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(got, want), "replayed with PDL edges"


def test_the_engine_generates_the_same_tokens_with_pdl(pdl, monkeypatch) -> None:
    from engine import LLM, SamplingParams

    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(100, 49152, (n,), generator=gen).tolist() for n in (5, 90, 300, 41)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    def tokens(flag: str) -> list[list[int]]:
        monkeypatch.setenv("PDSERVE_PDL", flag)
        llm = LLM("synthetic:smollm2-135m:layers=4", device="cuda", dtype="bfloat16",
                  attention_backend="triton", max_num_seqs=8, max_model_len=1024)  # fmt: skip
        assert pdl.enabled() == (flag == "1")
        outs = llm.generate(prompts, [params] * len(prompts))
        llm.engine.check_no_leaks()
        return [o.token_ids for o in outs]

    assert tokens("1") == tokens("0")


def test_chain_wins_are_close_to_cublas_at_their_token_counts(pdl) -> None:
    """Every CHAIN_WINS launch at the token counts it serves (a graph's padded batch sizes)."""
    import torch.nn.functional as F

    from kernels.gemm.skinny_config import CHAIN_WINS, measured_win
    from kernels.gemm.skinny_gemm import skinny_linear

    pdl.set_enabled(True)
    gen = torch.Generator(device="cuda").manual_seed(5)
    for max_m, n, k, config in CHAIN_WINS:
        w = (torch.randn(n, k, device="cuda", generator=gen) * k**-0.5).to(torch.bfloat16)
        for m in sorted({2, 4, max_m // 2 + 1, max_m} - {1}):
            chosen = measured_win(m, n, k, chained=True)
            if chosen is not config:
                continue  # an exact MEASURED_WINS launch or an earlier row takes this M
            x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
            got = skinny_linear(x, w, config=config)
            torch.testing.assert_close(got, F.linear(x, w), atol=3e-2, rtol=2e-2)
