"""LlamaForCausalLM over a paged flat batch equals Hugging Face transformers (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch

from engine.model import LoadedModel, load_model
from engine.model.llama import LlamaForCausalLM
from engine.model.loader import iter_safetensors
from kernels.attention.torch_backend import TorchAttentionBackend
from pdserve.config import ModelConfig
from tests.unit.engine.model.conftest import (
    HF_VARIANTS,
    assign_blocks,
    build_step,
    make_kv_caches,
    random_prompts,
)

BLOCK_SIZE = 4
PROMPT_LENS = [5, 17, 9, 30]  # different lengths, several crossing block boundaries


def load(path, dtype: torch.dtype = torch.float32) -> LoadedModel:
    return load_model(
        ModelConfig(model=str(path)), TorchAttentionBackend(), torch.device("cpu"), dtype
    )


def hf_logits(hf_model, tokens: list[int]) -> torch.Tensor:  # [len(tokens), vocab]
    with torch.inference_mode():
        return hf_model(torch.tensor([tokens])).logits[0].float()


@pytest.mark.parametrize("variant", sorted(HF_VARIANTS))
def test_prefill_batch_matches_transformers(variant, hf_checkpoints):
    checkpoint = hf_checkpoints[variant]
    loaded = load(checkpoint.path)
    prompts = random_prompts(PROMPT_LENS, loaded.arch.vocab_size, seed=1)
    block_ids, num_blocks = assign_blocks(PROMPT_LENS, BLOCK_SIZE)
    kv_caches = make_kv_caches(loaded.arch, num_blocks, BLOCK_SIZE)
    step = build_step([(p, 0) for p in prompts], block_ids, BLOCK_SIZE)

    with torch.inference_mode():
        hidden = loaded.model(step.input_ids, step.positions, kv_caches, step.meta)
        logits = loaded.model.compute_logits(hidden)  # every token's logits

    assert logits.dtype == torch.float32
    assert logits.shape == (sum(PROMPT_LENS), loaded.arch.vocab_size)
    for prompt, ours in zip(prompts, logits.split(PROMPT_LENS)):
        want = hf_logits(checkpoint.model, prompt)
        assert want.std() > 0.3, "reference logits too flat to be a meaningful check"
        torch.testing.assert_close(ours, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("variant", ["llama3-rope-tied", "qwen2-bias-tied", "qwen3-qk-norm"])
def test_decode_and_chunked_prefill_read_the_cache(variant, hf_checkpoints):
    """Step 1 prefills A, B and C's first chunk; step 2 decodes A and B (one token each,
    reading their cached prompt) and prefills C's second chunk on top of its cached first."""
    checkpoint = hf_checkpoints[variant]
    loaded = load(checkpoint.path)
    vocab = loaded.arch.vocab_size
    prompt_a, prompt_b, prompt_c = random_prompts([11, 6, 21], vocab, seed=2)
    next_a, next_b = 7, 300
    c_split = 13
    block_ids, num_blocks = assign_blocks([12, 7, 21], BLOCK_SIZE, seed=3)
    kv_caches = make_kv_caches(loaded.arch, num_blocks, BLOCK_SIZE)
    step1 = build_step(
        [(prompt_a, 0), (prompt_b, 0), (prompt_c[:c_split], 0)], block_ids, BLOCK_SIZE
    )
    step2 = build_step(
        [([next_a], 11), ([next_b], 6), (prompt_c[c_split:], c_split)], block_ids, BLOCK_SIZE
    )

    with torch.inference_mode():
        loaded.model(step1.input_ids, step1.positions, kv_caches, step1.meta)
        hidden = loaded.model(step2.input_ids, step2.positions, kv_caches, step2.meta)
        logits = loaded.model.compute_logits(hidden)
    assert step2.meta.num_decodes == 2

    torch.testing.assert_close(
        logits[0], hf_logits(checkpoint.model, [*prompt_a, next_a])[-1], atol=1e-4, rtol=1e-4
    )
    torch.testing.assert_close(
        logits[1], hf_logits(checkpoint.model, [*prompt_b, next_b])[-1], atol=1e-4, rtol=1e-4
    )
    torch.testing.assert_close(
        logits[2:], hf_logits(checkpoint.model, prompt_c)[c_split:], atol=1e-4, rtol=1e-4
    )


def test_on_layer_done_runs_after_each_layer_wrote_its_kv(hf_checkpoints):
    loaded = load(hf_checkpoints["llama"].path)
    block_ids, num_blocks = assign_blocks([9], BLOCK_SIZE)
    kv_caches = make_kv_caches(loaded.arch, num_blocks, BLOCK_SIZE)
    prompts = random_prompts([9], loaded.arch.vocab_size)
    step = build_step([(p, 0) for p in prompts], block_ids, BLOCK_SIZE)
    slots = step.meta.slot_mapping
    seen: list[tuple[int, list[bool]]] = []

    def on_layer_done(layer_idx: int) -> None:
        written = [bool(k.flatten(0, 1)[slots].abs().sum() > 0) for k, _ in kv_caches]
        seen.append((layer_idx, written))

    with torch.inference_mode():
        loaded.model(step.input_ids, step.positions, kv_caches, step.meta, on_layer_done)

    assert seen == [(0, [True, False]), (1, [True, True])]


def test_half_precision_runs_close_to_float32(hf_checkpoints):
    path = hf_checkpoints["qwen3-qk-norm"].path
    prompts = random_prompts([7, 12], 384, seed=4)
    block_ids, num_blocks = assign_blocks([7, 12], BLOCK_SIZE)
    logits = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        loaded = load(path, dtype)
        assert all(p.dtype == dtype for p in loaded.model.parameters())
        kv_caches = make_kv_caches(loaded.arch, num_blocks, BLOCK_SIZE, dtype)
        step = build_step([(p, 0) for p in prompts], block_ids, BLOCK_SIZE)
        with torch.inference_mode():
            hidden = loaded.model(step.input_ids, step.positions, kv_caches, step.meta)
            logits[dtype] = loaded.model.compute_logits(hidden)
    assert torch.get_default_dtype() == torch.float32  # the loader restored it
    for dtype in (torch.bfloat16, torch.float16):
        assert logits[dtype].dtype == torch.float32
        error = (logits[dtype] - logits[torch.float32]).abs().max()
        assert error < 0.1 * logits[torch.float32].abs().max(), f"{dtype}: max error {error}"


def _hf_weights(hf_model) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in hf_model.state_dict().items()}


def test_load_weights_names_missing_unexpected_and_misshaped(hf_checkpoints):
    checkpoint = hf_checkpoints["llama"]
    model = load(checkpoint.path).model
    weights = _hf_weights(checkpoint.model)

    missing = {k: v for k, v in weights.items() if k != "model.layers.1.self_attn.k_proj.weight"}
    with pytest.raises(ValueError, match=r"lacks 1 tensors.*layers\.1\.self_attn\.k_proj\.weight"):
        model.load_weights(missing.items())

    with pytest.raises(ValueError, match=r"not part of.*model\.layers\.2\.mlp\.up_proj\.weight"):
        model.load_weights(
            [*weights.items(), ("model.layers.2.mlp.up_proj.weight", torch.zeros(1))]
        )

    misshaped = dict(weights, **{"model.norm.weight": torch.ones(3)})
    with pytest.raises(ValueError, match=r"model\.norm\.weight has shape \(3,\).*expects \(64,\)"):
        model.load_weights(misshaped.items())


def test_load_weights_stacks_fused_projections(hf_checkpoints):
    checkpoint = hf_checkpoints["qwen2-bias-tied"]
    model = load(checkpoint.path).model
    weights = _hf_weights(checkpoint.model)
    attn = model.model.layers[1].self_attn
    prefix = "model.layers.1.self_attn"
    torch.testing.assert_close(
        attn.qkv_proj.bias,
        torch.cat([weights[f"{prefix}.{p}_proj.bias"] for p in "qkv"]),
        rtol=0,
        atol=0,
    )
    gate_up = model.model.layers[0].mlp.gate_up_proj.weight
    want = torch.cat([weights[f"model.layers.0.mlp.{p}_proj.weight"] for p in ("gate", "up")])
    assert torch.equal(gate_up, want)
    assert model.lm_head is None  # tied: logits use the embedding


def test_a_checkpoint_load_equals_random_init_then_load(hf_checkpoints):
    """load_model builds the model without the layers' random initialisation (the checkpoint
    overwrites every parameter): the same parameters and buffers as a model initialised at
    random and then loaded."""
    for variant in sorted(HF_VARIANTS):
        loaded = load(hf_checkpoints[variant].path)
        reference = LlamaForCausalLM(loaded.arch, TorchAttentionBackend())
        reference.load_weights(iter_safetensors(hf_checkpoints[variant].path))
        got, want = loaded.model.state_dict(), reference.state_dict()
        assert got.keys() == want.keys(), variant
        for name, tensor in want.items():
            assert torch.equal(got[name], tensor), f"{variant}: {name}"
