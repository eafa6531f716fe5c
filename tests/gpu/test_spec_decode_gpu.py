"""Speculative decoding on CUDA: the Triton (and flash-attn) decode path with K + 1 query
tokens per request (a verify batch) against the torch reference at realistic sizes, graphs of
the verify shape against eager, and speculative greedy against plain greedy through the
engine (n-gram; a model drafting for itself; a small draft). Skipped without CUDA."""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("CUDA not available", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).parents[1] / "unit" / "kernels" / "attention"))
from attention_batch import make_batch  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from kernels.attention import TorchAttentionBackend  # noqa: E402
from kernels.attention.triton_backend import TritonAttentionBackend  # noqa: E402

pytestmark = pytest.mark.gpu
HAS_FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}
LLAMA3_8B = (32, 8, 128)
SMOLLM2 = (9, 3, 64)
MODEL = "synthetic:smollm2-135m:layers=4"


def check_verify_batch(backend, shape, num_decodes, query_len, max_context, block_size, dtype):
    rng = random.Random(num_decodes * 100 + query_len)
    context_lens = [rng.randint(0, max_context) for _ in range(num_decodes)] + [37]
    query_lens = [query_len] * num_decodes + [300]  # and a prefill chunk after them
    num_heads, num_kv_heads, head_dim = shape
    batch = make_batch(
        query_lens, context_lens, num_decodes, num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, block_size=block_size, dtype=dtype, device="cuda",
        decode_query_len=query_len,
    )  # fmt: skip
    k_cache, v_cache = batch.clone_caches()
    args = (batch.q, batch.k, batch.v)
    expected = TorchAttentionBackend().forward(*args, k_cache, v_cache, batch.meta, batch.scale)
    out = backend.forward(*args, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [LLAMA3_8B, SMOLLM2], ids=["llama3-8b", "smollm2"])
@pytest.mark.parametrize(("num_decodes", "max_context"), [(1, 9000), (8, 3000), (32, 1024)])
@pytest.mark.parametrize("query_len", [2, 5, 9])
def test_triton_verify_batch(dtype, shape, num_decodes, max_context, query_len) -> None:
    check_verify_batch(
        TritonAttentionBackend(), shape, num_decodes, query_len, max_context, 16, dtype
    )


@pytest.mark.skipif(not HAS_FLASH_ATTN, reason="flash_attn is not installed")
@pytest.mark.parametrize("query_len", [2, 5])
def test_flash_attn_verify_batch(query_len) -> None:
    from kernels.attention.flash_attn_backend import FlashAttnBackend

    check_verify_batch(FlashAttnBackend(), LLAMA3_8B, 8, query_len, 3000, 256, torch.bfloat16)


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(2)
    lengths = torch.randint(3, 300, (12,), generator=gen).tolist()
    out = [torch.randint(100, 49152, (n,), generator=gen).tolist() for n in lengths]
    return [p * 2 for p in out]  # repeats: prompt lookup finds drafts


SPEC = {
    "ngram": dict(speculative_method="ngram", ngram_prompt_lookup_min=1),
    "draft-self": dict(speculative_method="draft", speculative_model=MODEL),
    "draft-small": dict(
        speculative_method="draft", speculative_model="synthetic:smollm2-135m:layers=1"
    ),
}


def run(dtype: str, enforce_eager: bool, backend: str = "triton", **spec) -> list[list[int]]:
    llm = LLM(MODEL, device="cuda", dtype=dtype, attention_backend=backend, max_num_seqs=8,
              max_model_len=1024, enforce_eager=enforce_eager, **spec)  # fmt: skip
    params = [SamplingParams(temperature=0.0, max_tokens=8 + 5 * (i % 5), ignore_eos=True)
              for i in range(len(prompts()))]  # fmt: skip
    outs = llm.generate(prompts(), params)
    llm.engine.check_no_leaks()
    if spec:
        runner = llm.engine.runner
        assert runner.verify_graphs is not None
        assert runner.verify_graphs.captured == (not enforce_eager)
        assert llm.engine.stats().spec_decode.num_verifies > 0
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("proposer", list(SPEC))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_verify_graphs_equal_eager(proposer: str, dtype: str) -> None:
    assert run(dtype, False, **SPEC[proposer]) == run(dtype, True, **SPEC[proposer])


@pytest.mark.parametrize("proposer", list(SPEC))
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_speculative_greedy_equals_plain_greedy_fp32(proposer: str, backend: str) -> None:
    """fp32 (bf16 rounds the verify step's K + 1 rows unlike a decode's: near-ties may flip)."""
    assert run("float32", False, backend, **SPEC[proposer]) == run("float32", False, backend)
