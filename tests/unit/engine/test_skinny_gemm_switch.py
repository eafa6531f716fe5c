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
from kernels.gemm import MAX_M, skinny_gemm_config, skinny_routing  # noqa: E402
from pdserve import envs  # noqa: E402
from tests.env_vars import assert_env_reads  # noqa: E402


@pytest.mark.parametrize(
    "value, want",
    [(None, MAX_M), ("", MAX_M), ("0", 0), ("16", 16), (" 64 ", 64), ("x", None), ("-1", None)],
)
def test_env_var_parses(monkeypatch: pytest.MonkeyPatch, value, want) -> None:
    assert_env_reads(monkeypatch, "PDSERVE_SKINNY_GEMM_MAX_M", value, want, envs.skinny_gemm_max_m)


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
    monkeypatch.setattr(skinny_routing, "skinny_linear", lambda *a, **k: calls.append(a) or a[0])
    weight = torch.zeros(4096, 4096, dtype=torch.bfloat16)
    for m in (2, 3, 16):  # not swept for this shape
        skinny_routing.routed_linear(
            torch.zeros(m, 4096, dtype=torch.bfloat16), weight, max_m=MAX_M
        )
    assert calls == []
    skinny_routing.routed_linear(torch.zeros(1, 4096, dtype=torch.bfloat16), weight, max_m=MAX_M)
    assert len(calls) == 1  # o_proj's shape at one token: measured faster
    skinny_routing.routed_linear(torch.zeros(1, 4096, dtype=torch.bfloat16), weight, max_m=0)
    assert len(calls) == 1  # switched off


class _SkinnyCalls:
    """Spies on the routing's skinny GEMM launches: the M of each call per weight, and which
    weights took the SwiGLU (gated) or the RMSNorm (normed) into the launch."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.seen: dict[int, set[int]] = {}  # weight data_ptr -> the M of each call
        self.gated: set[int] = set()
        self.normed: set[int] = set()
        real, real_normed = skinny_routing.skinny_linear, skinny_routing.skinny_norm_linear

        def spy(x, weight, bias=None, config=None, **kw):
            self.seen.setdefault(weight.data_ptr(), set()).add(x.shape[0])
            if kw.get("gated"):
                self.gated.add(weight.data_ptr())
            return real(x, weight, bias, config, **kw)

        def normed_spy(x, residual, norm_weight, eps, weight, bias=None, config=None):
            self.seen.setdefault(weight.data_ptr(), set()).add(residual.shape[0])
            self.normed.add(weight.data_ptr())
            return real_normed(x, residual, norm_weight, eps, weight, bias, config)

        monkeypatch.setattr(skinny_routing, "skinny_linear", spy)
        monkeypatch.setattr(skinny_routing, "skinny_norm_linear", normed_spy)


def test_small_steps_project_on_the_skinny_gemm(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a win recorded for every shape (the routing, not the table, is under test):
    prefill (every prompt > 4 tokens) on F.linear; decode steps of <= 4 tokens: every
    projection of every layer and the LM head on the skinny GEMM."""
    monkeypatch.setattr(
        skinny_routing,
        "measured_win",
        lambda m, n, k, chained=False: skinny_gemm_config(m, n, k),
    )
    monkeypatch.setattr(skinny_routing, "fused_config", skinny_gemm_config)
    # The ops are swapped after load: keep the plain (unpacked) weights the skinny GEMM reads.
    monkeypatch.setenv("PDSERVE_CPU_PACKED_GEMM", "0")
    llm = LLM("synthetic:tiny-llama", device="cpu", dtype="bfloat16", max_num_seqs=2,
              enable_prefix_caching=False)  # fmt: skip
    model = llm.engine.loaded.model
    model.set_layer_ops(with_skinny_gemm(triton_ops(), 4))
    assert model.layer_ops.name == "triton+skinny_gemm(M<=4)"
    calls = _SkinnyCalls(monkeypatch)
    prompts = [list(range(3, 11)), list(range(20, 29))]  # 8 and 9 tokens
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    assert [len(o.token_ids) for o in outputs] == [3, 3]
    layers = model.model.layers
    projections = [model.lm_head]
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        projections += [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
    for module in projections:
        ms = calls.seen.get(module.weight.data_ptr())
        assert ms and max(ms) <= 4, (module, ms)
    assert len(calls.seen) == len(projections)
    downs = {layer.mlp.down_proj.weight.data_ptr() for layer in layers}
    assert calls.gated == downs, "the down projections take the SwiGLU in the GEMM (one launch)"
    firsts = {
        w.data_ptr()
        for layer in layers
        for w in (layer.self_attn.qkv_proj.weight, layer.mlp.gate_up_proj.weight)
    }
    assert calls.normed == firsts, (
        "QKV and gate_up take the norm before them in the GEMM (one launch)"
    )
    llm.engine.check_no_leaks()
