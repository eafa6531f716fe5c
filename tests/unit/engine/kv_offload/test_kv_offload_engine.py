"""The host tier in a running engine (tiny model, CPU): a prefix evicted from a device pool too
small to keep it between turns comes back from host memory byte for byte, and the greedy tokens
are those of a cold run, through every path that frees or reuses blocks: chunked prefill,
preemption, async scheduling, the prefill-only role (blocks held until release), received KV
(cached once verified, never otherwise) and reservations that reuse a block still being
demoted."""

from __future__ import annotations

import pytest
import torch

from engine.block_hash import request_block_hashes
from engine.engine_core import EngineCore
from pdserve.cli import build_parser, engine_config
from pdserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pdserve.sampling_params import SamplingParams
from tests.unit.engine.conftest import random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
BLOCK_SIZE = 8
HOST_BYTES = 1 << 20  # 256 blocks of the tiny model


def make_engine(
    checkpoint, num_blocks: int, offload: int = HOST_BYTES, prefix_caching: bool = True, **sched
) -> EngineCore:
    sched.setdefault("max_num_batched_tokens", 64)
    # (a salt: both tiers are keyed by the salted hash chain)
    cache = CacheConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks, kv_offload_memory=offload,
                        enable_prefix_caching=prefix_caching, prefix_cache_salt="tenant-a")  # fmt: skip
    model = ModelConfig(model=str(checkpoint), device="cpu", dtype="float32")
    return EngineCore(EngineConfig(model=model, cache=cache, scheduler=SchedulerConfig(**sched)))


def run(engine: EngineCore, prompts: dict[str, list[int]], params=GREEDY) -> dict[str, list[int]]:
    """Add every prompt, step until drained; each request's tokens (prefill-only: the first)."""
    for request_id, prompt in prompts.items():
        engine.add_request(engine.make_request(request_id, prompt, params))
    tokens: dict[str, list[int]] = {request_id: [] for request_id in prompts}
    for _ in range(2000):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
    assert not engine.has_unfinished()
    return tokens


def cached_block_bytes(engine: EngineCore, prompt: list[int]) -> dict[bytes, bytes]:
    """Block hash -> the KV bytes of that block where the device cache holds it now."""
    manager = engine.kv_cache_manager
    probe = engine.make_request("probe", prompt + [3], GREEDY)
    block_ids, _ = manager.get_computed_blocks(probe)
    buffer = engine.pool.buffer
    return {
        block_hash: buffer[:, :, block_id].contiguous().view(torch.uint8).numpy().tobytes()
        for block_hash, block_id in zip(probe.block_hashes, block_ids, strict=False)
    }


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoints):
    return tiny_checkpoints["llama"]


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(6, 512, seed=21, min_len=60, max_len=70)


def test_a_host_tier_hit_gives_the_cold_run_tokens_from_byte_exact_kv(checkpoint, prompts):
    conversation, other = prompts[0], prompts[1]
    cold = make_engine(checkpoint, num_blocks=64, offload=0, prefix_caching=False)
    turn_1 = run(cold, {"t1": conversation})["t1"]
    turn_2_prompt = conversation + turn_1 + prompts[2][:9]
    want = run(cold, {"t2": turn_2_prompt})["t2"]

    engine = make_engine(checkpoint, num_blocks=12)  # 96 tokens: one conversation at a time
    assert run(engine, {"t1": conversation})["t1"] == turn_1
    computed = cached_block_bytes(engine, conversation)
    assert len(computed) == len(conversation) // BLOCK_SIZE
    run(engine, {"other": other})  # evicts most of the conversation's blocks from the device

    assert run(engine, {"t2": turn_2_prompt})["t2"] == want
    tier = engine.stats().kv_offload
    assert tier.host_hit_tokens >= (len(computed) - 3) * BLOCK_SIZE  # (the head may stay)
    assert tier.promotion_bytes == tier.host_hit_tokens // BLOCK_SIZE * engine.pool.bytes_per_block
    assert tier.offload_bytes > 0
    promoted = cached_block_bytes(engine, conversation)
    assert promoted == computed  # the promoted blocks hold the very bytes computed in turn 1
    engine.check_no_leaks()


def test_preemption_and_async_scheduling_with_the_host_tier(checkpoint, prompts):
    shared = prompts[3][:40]
    batch = {f"r{i}": shared + p[:20] for i, p in enumerate(prompts)}
    want = run(make_engine(checkpoint, num_blocks=128, offload=0), batch)
    engine = make_engine(checkpoint, num_blocks=14, async_scheduling="on", max_num_seqs=4)
    first = run(engine, batch)
    again = run(engine, {f"again-{k}": v for k, v in batch.items()})
    assert first == want
    assert again == {f"again-{k}": v for k, v in want.items()}
    assert engine.scheduler.num_preemptions > 0 and engine.num_steps_ahead > 0
    assert engine.stats().kv_offload.host_hit_tokens > 0
    engine.check_no_leaks()


def test_prefill_and_decode_roles_reuse_the_host_tier(checkpoint, prompts):
    """The prefill role's held blocks are demoted after release; the decode role's received KV
    once cached; a reservation that reuses a block whose demotion is queued waits for it."""
    prompt = prompts[4]
    want = run(make_engine(checkpoint, num_blocks=64, offload=0), {"r": prompt})["r"]
    prefill = make_engine(checkpoint, num_blocks=12, prefill_only=True)
    decode = make_engine(checkpoint, num_blocks=12)

    first_token = run(prefill, {"r": prompt})["r"]
    assert first_token == want[:1] and prefill.get_request("r") is not None  # held
    src = prefill.get_request("r").block_ids
    dst = decode.reserve("r", len(prompt) + 1)
    decode.pool.buffer[:, :, dst[: len(src)]] = prefill.pool.buffer[:, :, src]
    prefill.release("r")
    decode.add_prefilled(decode.make_request("r", prompt, GREEDY), dst, first_token[0])
    assert first_token + _drain(decode)["r"] == want

    for engine in (prefill, decode):
        # A reservation of the whole pool evicts the cached prompt, its demotion still
        # queued (no step launched since it was freed); garbage lands where a transfer would.
        reserved = engine.reserve("filler", engine.pool.num_blocks * BLOCK_SIZE)
        engine.pool.buffer[:, :, reserved] = float("nan")
        engine.abort("filler")
    assert run(prefill, {"again": prompt})["again"] == want[:1]
    prefill.release("again")
    assert run(decode, {"again": prompt})["again"] == want
    for engine in (prefill, decode):
        host_hit_tokens = engine.stats().kv_offload.host_hit_tokens
        assert host_hit_tokens == (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE
        engine.check_no_leaks()


def _drain(engine: EngineCore) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for _ in range(2000):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


def test_unverified_received_kv_never_reaches_the_host_tier(checkpoint, prompts):
    decode = make_engine(checkpoint, num_blocks=12)
    prompt = prompts[0]
    dst = decode.reserve("r", len(prompt) + 1)
    request = decode.make_request("r", prompt, GREEDY)
    request.cache_kv = False  # the hand-off was not authenticated
    decode.add_prefilled(request, dst, first_token=5)
    _drain(decode)
    run(decode, {"other": prompts[1]})
    tier = decode.kv_cache_manager.host_tier
    root = decode.kv_cache_manager.root_hash
    hashes = request_block_hashes(request, len(prompt) // BLOCK_SIZE, BLOCK_SIZE, root)
    assert [tier.find(block_hash) for block_hash in hashes] == [None] * len(hashes)
    stats = decode.stats().kv_offload
    assert stats.num_free_host_blocks < stats.num_host_blocks  # `other`'s blocks only
    decode.check_no_leaks()


def test_the_knob_and_its_refusals(checkpoint):
    args = build_parser("decode").parse_args(["--kv-offload-memory", "2GiB"])
    assert engine_config(args, prefill_only=False).cache.kv_offload_memory == 2 << 30
    assert build_parser("decode").parse_args([]).kv_offload_memory == 0
    assert make_engine(checkpoint, num_blocks=8, offload=0).kv_offload is None
    with pytest.raises(ValueError, match="needs prefix caching"):
        make_engine(checkpoint, num_blocks=8, prefix_caching=False)
    with pytest.raises(ValueError, match="holds no KV block"):
        make_engine(checkpoint, num_blocks=8, offload=100)


@pytest.mark.slow
def test_the_default_model_continues_a_conversation_from_the_host_tier():
    """SmolLM2-135M (fp32, CPU): turn 2 of a conversation whose turn 1 was evicted from a
    64-block device pool gives the cold run's greedy tokens."""
    from engine import LLM

    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    gen = torch.Generator().manual_seed(3)
    conversation, other, follow_up = (
        torch.randint(100, 49000, (n,), generator=gen).tolist() for n in (300, 330, 20)
    )
    cold = LLM("smollm2-135m", device="cpu", dtype="float32", enable_prefix_caching=False)
    turn_1 = cold.generate([conversation], params)[0].token_ids
    turn_2_prompt = conversation + turn_1 + follow_up
    want = cold.generate([turn_2_prompt], params)[0].token_ids
    del cold
    llm = LLM("smollm2-135m", device="cpu", dtype="float32", num_blocks=24,
              kv_offload_memory=64 << 20)  # fmt: skip
    assert llm.generate([conversation], params)[0].token_ids == turn_1
    llm.generate([other], params)  # 346 of the pool's 384 tokens: turn 1's blocks go
    turn_2 = llm.generate([turn_2_prompt], params)[0]
    assert turn_2.token_ids == want
    assert llm.engine.stats().kv_offload.host_hit_tokens >= 256
    llm.engine.check_no_leaks()
