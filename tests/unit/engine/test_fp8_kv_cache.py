"""`--kv-cache-dtype fp8_e4m3` in a running engine (tiny model, CPU): the pool holds twice the
bf16 blocks in the same memory, and the prefix cache and the host tier reuse FP8 blocks byte
for byte (the greedy tokens of a cold FP8 run)."""

from __future__ import annotations

import pytest
import torch

from engine.engine_core import EngineCore
from engine.kv_cache_pool import KVCachePool
from engine.model.synthetic import parse_synthetic
from pdserve.cli import build_parser, engine_config
from pdserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pdserve.sampling_params import SamplingParams
from tests.unit.engine.conftest import random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
FP8 = torch.float8_e4m3fn


def test_the_flag_reaches_the_cache_config() -> None:
    args = build_parser("decode").parse_args(["--kv-cache-dtype", "fp8_e4m3"])
    assert engine_config(args).cache.kv_cache_dtype == "fp8_e4m3"


def test_fp8_kv_with_tensor_parallelism_is_refused_at_start(capsys) -> None:
    """FP8 KV is not wired for TP: the engine's config, a node's launcher and pd-serve refuse
    the pair before any rank or node starts, naming both flags; each alone is accepted."""
    from decode_node.decode_server import DecodeServer
    from node_common.launcher import run_node
    from pdserve.local_cluster import main as pd_serve

    with pytest.raises(ValueError, match="fp8_e4m3 with --tensor-parallel-size 2"):
        EngineConfig.from_kwargs(kv_cache_dtype="fp8_e4m3", tensor_parallel_size=2)
    EngineConfig.from_kwargs(kv_cache_dtype="fp8_e4m3", tensor_parallel_size=1)
    EngineConfig.from_kwargs(kv_cache_dtype="auto", tensor_parallel_size=2)
    argv = ["--model", "synthetic:tiny-llama", "--device", "cpu", "--kv-cache-dtype", "fp8_e4m3"]
    with pytest.raises(SystemExit) as exit_info:
        run_node(DecodeServer, [*argv, "--tensor-parallel-size", "2", "--port", "0"])
    assert exit_info.value.code == 2
    assert "not supported with tensor parallelism" in capsys.readouterr().err
    assert pd_serve([*argv, "--prefill", "1", "--decode-tp", "2"]) == 2
    err = capsys.readouterr().err
    assert "pd-serve: --kv-cache-dtype fp8_e4m3 with --tensor-parallel-size 2" in err


def test_fp8_pool_holds_twice_the_bf16_blocks_in_the_same_memory() -> None:
    arch = parse_synthetic("synthetic:tiny-llama")
    budget = 3 << 20
    pools = {
        kv_dtype: KVCachePool(
            arch,
            CacheConfig(kv_cache_memory=budget, kv_cache_dtype=kv_dtype),
            torch.device("cpu"),
            torch.bfloat16,
        )  # fmt: skip
        for kv_dtype in ("auto", "fp8_e4m3")
    }
    bf16, fp8 = pools["auto"], pools["fp8_e4m3"]

    assert bf16.buffer.dtype == torch.bfloat16 and fp8.buffer.dtype == FP8
    assert 2 * fp8.bytes_per_block == bf16.bytes_per_block
    assert fp8.num_blocks == 2 * bf16.num_blocks
    assert fp8.num_bytes <= budget and bf16.kv_scales is None
    assert fp8.kv_scales is not None
    assert fp8.kv_scales.shape == (arch.num_layers, 2, arch.num_kv_heads)


def make_engine(checkpoint, num_blocks: int, offload: int = 0, prefix_caching: bool = True):
    cache = CacheConfig(block_size=8, num_blocks=num_blocks, kv_offload_memory=offload,
                        enable_prefix_caching=prefix_caching, kv_cache_dtype="fp8_e4m3")  # fmt: skip
    model = ModelConfig(model=str(checkpoint), device="cpu", dtype="float32")
    scheduler = SchedulerConfig(max_num_batched_tokens=64)
    return EngineCore(EngineConfig(model=model, cache=cache, scheduler=scheduler))


def run(engine: EngineCore, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    for request_id, prompt in prompts.items():
        engine.add_request(engine.make_request(request_id, prompt, GREEDY))
    tokens: dict[str, list[int]] = {request_id: [] for request_id in prompts}
    for _ in range(2000):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
    assert not engine.has_unfinished()
    return tokens


def test_prefix_cache_and_host_tier_reuse_fp8_blocks(tiny_checkpoints) -> None:
    checkpoint = tiny_checkpoints["llama"]
    conversation, other, tail = random_prompts(3, 512, seed=21, min_len=60, max_len=70)
    cold = make_engine(checkpoint, num_blocks=64, prefix_caching=False)
    assert cold.pool.buffer.dtype == FP8
    turn_1 = run(cold, {"t1": conversation})["t1"]
    turn_2_prompt = conversation + turn_1 + tail[:9]
    want = run(cold, {"t2": turn_2_prompt})["t2"]

    cached = make_engine(checkpoint, num_blocks=64)  # the prefix cache, on the device
    assert run(cached, {"t1": conversation})["t1"] == turn_1
    assert run(cached, {"t2": turn_2_prompt})["t2"] == want
    assert cached.stats().prefix_cache_hit_tokens >= len(conversation) // 8 * 8
    cached.check_no_leaks()

    tiered = make_engine(checkpoint, num_blocks=12, offload=1 << 20)  # one conversation fits
    assert run(tiered, {"t1": conversation})["t1"] == turn_1
    run(tiered, {"other": other})  # evicts the conversation's blocks to the host tier
    assert run(tiered, {"t2": turn_2_prompt})["t2"] == want
    tier = tiered.stats().kv_offload
    assert tier.host_hit_tokens > 0 and tier.offload_bytes > 0
    assert tier.promotion_bytes == tier.host_hit_tokens // 8 * tiered.pool.bytes_per_block
    assert tiered.kv_offload is not None
    tiered.check_no_leaks()
