"""The fused per-layer Triton kernels (kernels/fused) compiled on the GPU: against the torch
reference at model sizes, inside the engine (same greedy tokens as the reference ops in
float32, eager and CUDA graphs; close logits in bfloat16), and the kernels a decode step
launches per layer. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from kernels.fused import REFERENCE_OPS, get_layer_ops

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available"),
]
MODEL = "synthetic:smollm2-135m:layers=4"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _tol(dtype):
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 2e-2}


@pytest.fixture(scope="module")
def ops():
    return get_layer_ops("triton", torch.device("cuda"))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 37, 4096])
def test_add_rms_norm_at_llama3_8b_width(ops, dtype, num_tokens) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    x, res = (
        torch.randn(num_tokens, 4096, device="cuda", generator=gen).to(dtype) for _ in range(2)
    )
    w = torch.rand(4096, device="cuda", generator=gen).to(dtype) + 0.5
    want_out, want_res = REFERENCE_OPS.add_rms_norm(x, res.clone(), w, 1e-5)
    out, new_res = ops.add_rms_norm(x, res, w, 1e-5)
    assert torch.equal(new_res, want_res), "the residual sum rounds as torch does"
    torch.testing.assert_close(out, want_out, **_tol(dtype))
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), REFERENCE_OPS.rms_norm(x, w, 1e-5),
                               **_tol(dtype))  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary_qk_matches_reference(ops, dtype, head_dim) -> None:
    gen = torch.Generator(device="cuda").manual_seed(1)
    num_tokens, heads, kv_heads = 53, 32, 8
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, device="cuda",
                      generator=gen).to(dtype)  # fmt: skip
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(num_tokens, heads, head_dim), k.view(num_tokens, kv_heads, head_dim)
    angles = torch.rand(num_tokens, head_dim // 2, device="cuda", generator=gen) * 100
    cos_sin = torch.cat((angles.cos(), angles.sin()), dim=-1).to(dtype)
    cos, sin = cos_sin.unsqueeze(1).chunk(2, dim=-1)
    want_q, want_k = REFERENCE_OPS.rotary_qk(q.clone(), k.clone(), cos, sin)
    got_q, got_k = ops.rotary_qk(q, k, cos, sin)
    torch.testing.assert_close(got_q, want_q, **_tol(dtype))
    torch.testing.assert_close(got_k, want_k, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_qk_write_kv_matches_reference(ops, dtype) -> None:
    gen = torch.Generator(device="cuda").manual_seed(4)
    num_tokens, heads, kv_heads, head_dim, block_size = 70, 32, 8, 128, 16
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, device="cuda",
                      generator=gen).to(dtype)  # fmt: skip
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = (t.view(num_tokens, -1, head_dim) for t in (q, k, v))
    angles = torch.rand(num_tokens, head_dim // 2, device="cuda", generator=gen) * 100
    cos, sin = torch.cat((angles.cos(), angles.sin()), -1).to(dtype).unsqueeze(1).chunk(2, -1)
    slots = torch.randperm(64 * block_size, device="cuda", generator=gen)[:num_tokens]
    shape = (64, block_size, kv_heads, head_dim)
    want = [torch.zeros(shape, dtype=dtype, device="cuda") for _ in range(2)]
    got = [torch.zeros(shape, dtype=dtype, device="cuda") for _ in range(2)]
    want_q, want_k = REFERENCE_OPS.rotary_qk_write_kv(q.clone(), k.clone(), v, cos, sin, *want,
                                                      slots)  # fmt: skip
    got_q, got_k = ops.rotary_qk_write_kv(q, k, v, cos, sin, *got, slots)
    torch.testing.assert_close(got_q, want_q, **_tol(dtype))
    torch.testing.assert_close(got_k, want_k, **_tol(dtype))
    torch.testing.assert_close(got[0], want[0], **_tol(dtype))
    assert torch.equal(got[1], want[1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_reference(ops, dtype) -> None:
    gen = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(33, 2 * 14336, device="cuda", generator=gen).to(dtype)
    torch.testing.assert_close(ops.silu_and_mul(x), REFERENCE_OPS.silu_and_mul(x), **_tol(dtype))


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    lengths = torch.randint(3, 300, (10,), generator=gen).tolist()
    return [torch.randint(100, 49152, (n,), generator=gen).tolist() for n in lengths]


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graphs"])
def test_engine_tokens_fused_equal_reference_fp32(enforce_eager: bool) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    def generate(fused: bool) -> list[list[int]]:
        llm = LLM(MODEL, device="cuda", dtype="float32", attention_backend="triton",
                  enforce_eager=enforce_eager, max_num_seqs=8, max_model_len=1024,
                  enable_prefix_caching=False)  # fmt: skip
        model = llm.engine.loaded.model
        # (+skinny_gemm: the one-token projections in fp16/bf16 only, not in this fp32 run)
        assert model.layer_ops.name.startswith("triton")
        if not fused:  # before any graph replays: eager only (the graphs hold the fused ops)
            model.set_layer_ops(REFERENCE_OPS)
            llm.engine.runner.decode_graphs = None
        out = [o.token_ids for o in llm.generate(_prompts(), params)]
        llm.engine.check_no_leaks()
        return out

    assert generate(True) == generate(False)


def test_engine_logits_fused_close_to_reference_bf16() -> None:
    llm = LLM(MODEL, device="cuda", dtype="bfloat16", attention_backend="triton",
              enforce_eager=True, max_model_len=1024, enable_prefix_caching=False)  # fmt: skip
    model = llm.engine.loaded.model
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=5)
    fused = llm.generate(_prompts(), params)
    model.set_layer_ops(REFERENCE_OPS)
    ref = llm.generate(_prompts(), params)
    agree = sum(a.token_ids == b.token_ids for a, b in zip(fused, ref))
    assert agree >= len(ref) - 1, f"first tokens agree on {agree} of {len(ref)} prompts"
    for a, b in zip(fused, ref):
        top_a = dict(a.logprobs[0].top)
        top_b = dict(b.logprobs[0].top)
        for token in top_a.keys() & top_b.keys():
            assert abs(top_a[token] - top_b[token]) < 0.2


def test_eager_decode_launches_few_kernels_per_layer() -> None:
    """One eager decode step, profiled on 4 and 2 layers: the difference / 2 is one layer's
    kernels (fused add+norm x2, QKV, rotary + KV write, attention (+ merge), o_proj, gate_up,
    SwiGLU, down: about 10)."""
    from torch.profiler import ProfilerActivity, profile

    def kernels_per_step(layers: int) -> int:
        llm = LLM(f"synthetic:smollm2-135m:layers={layers}", device="cuda", dtype="bfloat16",
                  attention_backend="triton", enforce_eager=True, max_num_seqs=4,
                  max_model_len=512)  # fmt: skip
        core = llm.engine
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        for i in range(2):
            core.add_request(core.make_request(f"r{i}", list(range(10, 60 + i)), params))
        core.step()  # prefill
        core.step()  # a warm decode step (Triton compiles)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            core.step()
            torch.cuda.synchronize()
        return sum(1 for e in prof.events() if e.device_type.name == "CUDA")

    per_layer = (kernels_per_step(4) - kernels_per_step(2)) / 2
    assert 0 < per_layer <= 16, f"{per_layer} kernels per layer"


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graphs"])
def test_a_decode_step_syncs_once(enforce_eager: bool) -> None:
    """Inputs, forward, sampler (greedy, seeded top-k/top-p/min-p, penalties, min_tokens,
    logprobs) of a decode step: the only device sync is the copy of the sampled ids."""
    import warnings

    llm = LLM(MODEL, device="cuda", dtype="bfloat16", attention_backend="triton",
              enforce_eager=enforce_eager, max_num_seqs=8, max_model_len=512)  # fmt: skip
    core = llm.engine
    params = [
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
        SamplingParams(
            temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, seed=7, max_tokens=8, ignore_eos=True
        ),
        SamplingParams(
            temperature=1.0,
            repetition_penalty=1.2,
            presence_penalty=0.5,
            frequency_penalty=0.3,
            min_tokens=4,
            max_tokens=8,
            logprobs=3,
        ),
        SamplingParams(temperature=0.7, max_tokens=8, ignore_eos=True),
    ]  # the third's min_tokens masks EOS: nobody stops before the measured step
    for i, p in enumerate(params):
        core.add_request(core.make_request(f"r{i}", list(range(20, 60 + 7 * i)), p))
    core.step()  # the prefills
    core.step()  # a first decode step (compiles, pins host buffers)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            outputs = core.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message).lower()]
    assert len(outputs) == len(params)
    assert len(syncs) <= 1, syncs
