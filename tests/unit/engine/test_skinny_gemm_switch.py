"""PDSERVE_SKINNY_GEMM_MAX_M reaches the layer ops, and with it the model's projections of
small steps run on the Triton skinny GEMM (kernels/gemm; on CPU through the Triton interpreter)
where it measured faster (MEASURED_WINS), everything else on F.linear."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton", reason="triton is not installed (pip install --no-deps triton)")

from engine import LLM, SamplingParams  # noqa: E402
from engine.model import loader  # noqa: E402
from kernels.fused import REFERENCE_OPS  # noqa: E402
from kernels.fused.layer_ops import triton_ops, with_skinny_gemm  # noqa: E402
from kernels.gemm import MAX_M, skinny_gemm  # noqa: E402
from pdserve import envs  # noqa: E402


@pytest.mark.parametrize(
    "value, want",
    [(None, MAX_M), ("", MAX_M), ("0", 0), ("16", 16), (" 64 ", 64), ("x", None), ("-1", None)],
)
def test_env_var_parses(monkeypatch: pytest.MonkeyPatch, value, want) -> None:
    if value is None:
        monkeypatch.delenv("PDSERVE_SKINNY_GEMM_MAX_M", raising=False)
    else:
        monkeypatch.setenv("PDSERVE_SKINNY_GEMM_MAX_M", value)
    if want is None:
        with pytest.raises(ValueError, match="PDSERVE_SKINNY_GEMM_MAX_M"):
            envs.skinny_gemm_max_m()
    else:
        assert envs.skinny_gemm_max_m() == want


def test_the_loader_passes_the_env_var_to_the_layer_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []

    def spy(backend, device, skinny_gemm_max_m=0):
        seen.append(skinny_gemm_max_m)
        return REFERENCE_OPS

    monkeypatch.setattr(loader, "get_layer_ops", spy)
    monkeypatch.setenv("PDSERVE_SKINNY_GEMM_MAX_M", "8")
    LLM("synthetic:tiny-llama", device="cpu", dtype="float32")
    assert seen == [8]


def test_max_m_above_the_kernel_cap_is_refused() -> None:
    with pytest.raises(ValueError, match=f"1..{MAX_M} tokens"):
        with_skinny_gemm(triton_ops(), MAX_M + 1)


def test_unmeasured_shapes_stay_on_cublas(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only an (M, N, K) with a measured win leaves F.linear: another M, or another shape,
    does not (tiny-llama's shapes were never measured)."""
    calls = []
    monkeypatch.setattr(skinny_gemm, "skinny_linear", lambda *a, **k: calls.append(a) or a[0])
    weight = torch.zeros(4096, 4096, dtype=torch.bfloat16)
    for m in (2, 3, 16):  # not swept for this shape
        skinny_gemm.routed_linear(torch.zeros(m, 4096, dtype=torch.bfloat16), weight, max_m=MAX_M)
    assert calls == []
    skinny_gemm.routed_linear(torch.zeros(1, 4096, dtype=torch.bfloat16), weight, max_m=MAX_M)
    assert len(calls) == 1  # o_proj's shape at one token: measured faster
    skinny_gemm.routed_linear(torch.zeros(1, 4096, dtype=torch.bfloat16), weight, max_m=0)
    assert len(calls) == 1  # switched off


def test_small_steps_project_on_the_skinny_gemm(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a win recorded for every shape (the routing, not the table, is under test):
    prefill (every prompt > 4 tokens) on F.linear; decode steps of <= 4 tokens: every
    projection of every layer and the LM head on the skinny GEMM."""
    monkeypatch.setattr(skinny_gemm, "measured_win", skinny_gemm.skinny_gemm_config)
    llm = LLM("synthetic:tiny-llama", device="cpu", dtype="bfloat16", max_num_seqs=2,
              enable_prefix_caching=False)  # fmt: skip
    model = llm.engine.loaded.model
    model.set_layer_ops(with_skinny_gemm(triton_ops(), 4))
    assert model.layer_ops.name == "triton+skinny_gemm(M<=4)"
    seen: dict[int, set[int]] = {}  # weight data_ptr -> the M of each call
    real = skinny_gemm.skinny_linear

    def spy(x, weight, bias=None, config=None):
        seen.setdefault(weight.data_ptr(), set()).add(x.shape[0])
        return real(x, weight, bias, config)

    monkeypatch.setattr(skinny_gemm, "skinny_linear", spy)
    prompts = [list(range(3, 11)), list(range(20, 29))]  # 8 and 9 tokens
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    assert [len(o.token_ids) for o in outputs] == [3, 3]
    projections = [model.lm_head]
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        projections += [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
    for module in projections:
        ms = seen.get(module.weight.data_ptr())
        assert ms and max(ms) <= 4, (module, ms)
    assert len(seen) == len(projections)
    llm.engine.check_no_leaks()
