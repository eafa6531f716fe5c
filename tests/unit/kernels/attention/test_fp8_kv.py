"""FP8 KV cache in the torch backend: the write quantizes with each KV head's scale, the read
dequantizes, and attention equals the dense reference over the dequantized values."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from attention_batch import make_batch, reference_attention

from kernels.attention import TorchAttentionBackend, get_attention_backend, kv_quant, selector
from kernels.attention.torch_backend import write_kv_cache

FP8 = torch.float8_e4m3fn


def test_quantize_keeps_e4m3_precision_per_head_and_saturates() -> None:
    x = torch.randn(64, 2, 16) * torch.tensor([1.0, 40.0])[None, :, None]  # head 1: 40x larger
    scale = torch.tensor([1.0, 32.0])
    stored = kv_quant.quantize(x, scale)
    back = kv_quant.dequantize(stored, scale, torch.float32)

    assert stored.dtype == FP8
    # e4m3: 3 mantissa bits, rounding to nearest: relative error <= 2^-4 for normal values
    normal = x.abs() / scale[:, None] >= 2**-6
    assert ((back - x).abs() <= x.abs() * 2**-4 + 1e-6)[normal].all()
    huge = kv_quant.quantize(torch.tensor([[[1e6, -1e6]]]), torch.tensor([1.0]))
    assert huge.float().tolist() == [[[448.0, -448.0]]]  # saturated, never NaN


@pytest.mark.parametrize("static_shapes", [False, True])
def test_torch_backend_attends_over_the_dequantized_fp8_cache(static_shapes: bool) -> None:
    batch = make_batch([1, 1, 5, 9], [17, 40, 0, 23], num_decodes=2, num_heads=4,
                       num_kv_heads=2, head_dim=16, block_size=8, seed=3)  # fmt: skip
    scales = torch.tensor([[0.5, 2.0], [1.0, 0.25]])  # [K/V, head]
    k_cache = kv_quant.quantize(batch.k_cache.flatten(0, 1), scales[0]).view_as(batch.k_cache)
    v_cache = kv_quant.quantize(batch.v_cache.flatten(0, 1), scales[1]).view_as(batch.v_cache)
    meta = batch.meta
    if static_shapes:  # a decode-only graph batch: the plan from the device tensors only
        batch = make_batch([1, 1], [17, 40], num_decodes=2, num_heads=4, num_kv_heads=2,
                           head_dim=16, block_size=8, seed=3)  # fmt: skip
        k_cache = kv_quant.quantize(batch.k_cache.flatten(0, 1), scales[0]).view_as(batch.k_cache)
        v_cache = kv_quant.quantize(batch.v_cache.flatten(0, 1), scales[1]).view_as(batch.v_cache)
        meta = dataclasses.replace(batch.meta, static_shapes=True)

    out = TorchAttentionBackend().forward(
        batch.q, batch.k, batch.v, k_cache, v_cache, meta, batch.scale, kv_scales=scales
    )

    # the oracle: the same attention over the values the FP8 cache holds
    deq = dataclasses.replace(
        batch,
        k=kv_quant.dequantize(kv_quant.quantize(batch.k, scales[0]), scales[0], torch.float32),
        v=kv_quant.dequantize(kv_quant.quantize(batch.v, scales[1]), scales[1], torch.float32),
        k_cache=kv_quant.dequantize(k_cache, scales[0], torch.float32),
        v_cache=kv_quant.dequantize(v_cache, scales[1], torch.float32),
    )
    torch.testing.assert_close(out, reference_attention(deq), atol=1e-5, rtol=1e-5)
    # the new tokens were stored quantized at their slots
    slots = batch.meta.slot_mapping
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    assert torch.equal(flat_k[slots].view(torch.uint8),
                       kv_quant.quantize(batch.k, scales[0]).view(torch.uint8))  # fmt: skip


def test_an_fp8_write_without_scales_is_refused() -> None:
    cache = torch.zeros(2, 4, 1, 8, dtype=FP8)
    k = torch.randn(1, 1, 8)
    with pytest.raises(ValueError, match="needs its kv_scales"):
        write_kv_cache(k, k, cache, cache.clone(), torch.tensor([0]))


def test_selector_refuses_flash_attn_for_fp8_and_keeps_the_cpu_kernel_off() -> None:
    cpu = torch.device("cpu")
    backend = get_attention_backend("auto", cpu, torch.bfloat16, 16, kv_cache_dtype="fp8_e4m3")
    assert isinstance(backend, TorchAttentionBackend)
    cuda = torch.device("cuda")  # (only named: nothing is allocated)
    why = selector.unavailable_reason("flash_attn", cuda, torch.bfloat16, 256, "fp8_e4m3")
    assert why is not None and "does not read a fp8_e4m3 KV cache" in why
    with pytest.raises(ValueError, match="does not read a fp8_e4m3 KV cache"):
        selector.resolve_backend_name("flash_attn", cuda, torch.bfloat16, 256, "fp8_e4m3")
