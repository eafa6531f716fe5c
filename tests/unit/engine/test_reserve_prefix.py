"""`EngineCore.reserve_prefix`: a decode engine that holds a conversation's earlier turn takes
only the new blocks for the next turn's KV (the prefix hits held at once), admits the request
with the received suffix, and continues with the tokens of an engine with prefix caching off:
also when the pool is squeezed between the reservation and the KV's arrival (the hits cannot
be evicted), when the hits come from the host tier, and when the reservation is given up."""

from __future__ import annotations

import pytest

from engine.block_hash import request_block_hashes
from engine.engine_core import EngineCore, NoFreeBlocksError
from pdserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pdserve.sampling_params import SamplingParams
from tests.unit.engine.conftest import random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
BLOCK_SIZE = 8


def make_engine(checkpoint, num_blocks: int, prefix: bool = True, offload: int = 0, **sched):
    sched.setdefault("max_num_batched_tokens", 64)
    cache = CacheConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks, kv_offload_memory=offload,
                        enable_prefix_caching=prefix, prefix_cache_salt="t")  # fmt: skip
    model = ModelConfig(model=str(checkpoint), device="cpu", dtype="float32")
    return EngineCore(EngineConfig(model=model, cache=cache, scheduler=SchedulerConfig(**sched)))


def drain(engine: EngineCore) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for _ in range(2000):
        if not engine.has_unfinished():
            return tokens
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    raise AssertionError("the engine did not drain")


def prefill_blocks(prefill: EngineCore, request_id: str, prompt: list[int]):
    """Run `prompt` on a prefill-only engine: (first token, its block ids; held until release)."""
    prefill.add_request(prefill.make_request(request_id, prompt, GREEDY))
    for _ in range(100):
        done = [o for o in prefill.step() if o.prefill_done]
        if done:
            return done[0].new_token_ids[0], list(prefill.get_request(request_id).block_ids)
    raise AssertionError("no first token")


def copy_blocks(src: EngineCore, src_ids, dst: EngineCore, dst_ids) -> None:
    for (src_k, src_v), (dst_k, dst_v) in zip(src.pool.kv_caches, dst.pool.kv_caches, strict=True):
        dst_k[dst_ids] = src_k[src_ids]
        dst_v[dst_ids] = src_v[src_ids]


@pytest.fixture
def turns(tiny_checkpoints):
    """Turn 1's prompt and turn 2's (turn 1 + its greedy answer + new tokens); the reference
    tokens of turn 2 from an engine with prefix caching off."""
    checkpoint = tiny_checkpoints["llama"]
    first = random_prompts(1, 512, seed=5, min_len=45, max_len=45)[0]
    cold = make_engine(checkpoint, 64, prefix=False)
    cold.add_request(cold.make_request("t1", first, GREEDY))
    answer = drain(cold)["t1"]
    second = first + answer + random_prompts(1, 512, seed=6, min_len=13, max_len=13)[0]
    cold.add_request(cold.make_request("t2", second, GREEDY))
    return checkpoint, first, second, drain(cold)["t2"]


def hand_off_turn_two(decode: EngineCore, checkpoint, second, squeeze=None):
    """Reserve turn 2 on `decode` (turn 1 ran there), copy only the suffix blocks from a cold
    prefill engine, admit it; `squeeze(decode)` runs between the reservation and the copy."""
    request = decode.make_request("t2", second, GREEDY)
    reserved = decode.reserve_prefix(request, len(second) + 1)
    num_cached = reserved.num_cached_blocks
    # turn 1's computed tokens (its last answer token never was) in full blocks
    assert num_cached == (len(second) - 13 - 1) // BLOCK_SIZE
    if squeeze is not None:
        squeeze(decode)
    prefill = make_engine(checkpoint, 64, prefill_only=True)
    first_token, src_ids = prefill_blocks(prefill, "t2", second)
    num_blocks = -(-len(second) // BLOCK_SIZE)
    copy_blocks(prefill, src_ids[num_cached:num_blocks], decode, reserved.block_ids[num_cached:])
    prefill.release("t2")
    decode.add_prefilled(request, reserved.block_ids, first_token)
    return [first_token] + drain(decode).get("t2", []), num_cached


def test_second_turn_reuses_the_first_and_gives_cold_tokens(turns):
    checkpoint, first, second, expected = turns
    decode = make_engine(checkpoint, 64)
    decode.add_request(decode.make_request("t1", first, GREEDY))
    drain(decode)
    hits_before = decode.stats().prefix_cache_hit_tokens
    tokens, num_cached = hand_off_turn_two(decode, checkpoint, second)
    assert tokens == expected
    assert decode.stats().prefix_cache_hit_tokens - hits_before == num_cached * BLOCK_SIZE
    decode.check_no_leaks()


def test_hits_survive_a_squeeze_between_reservation_and_use(turns):
    """Other requests take every free block after the reservation: the hits stay (held)."""
    checkpoint, first, second, expected = turns
    decode = make_engine(checkpoint, 24)
    decode.add_request(decode.make_request("t1", first, GREEDY))
    drain(decode)

    def squeeze(engine: EngineCore) -> None:
        free = engine.kv_cache_manager.num_free_blocks
        hog = engine.reserve("hog", free * BLOCK_SIZE)  # every block left, cached ones too
        assert engine.kv_cache_manager.num_free_blocks == 0 and hog
        with pytest.raises(NoFreeBlocksError):
            engine.reserve("more", 1)
        engine.abort("hog")

    tokens, _ = hand_off_turn_two(decode, checkpoint, second, squeeze)
    assert tokens == expected
    decode.check_no_leaks()


def test_hits_from_the_host_tier(turns):
    """Turn 1's blocks were evicted from the device (other prompts) and live in host memory:
    the reservation promotes them and the tokens stay cold-run tokens."""
    checkpoint, first, second, expected = turns
    decode = make_engine(checkpoint, 16, offload=1 << 20)
    decode.add_request(decode.make_request("t1", first, GREEDY))
    drain(decode)
    for i, other in enumerate(random_prompts(3, 512, seed=9, min_len=100, max_len=100)):
        decode.add_request(decode.make_request(f"o{i}", other, GREEDY))
        drain(decode)
    probe = decode.make_request("probe", second, GREEDY)
    manager = decode.kv_cache_manager
    hashes = request_block_hashes(probe, 2, BLOCK_SIZE, manager.root_hash)
    assert hashes[0] not in manager._cached  # evicted from the device, kept in host memory
    tokens, _ = hand_off_turn_two(decode, checkpoint, second)
    assert tokens == expected
    assert decode.stats().kv_offload.host_hit_tokens > 0
    decode.check_no_leaks()


def test_a_given_up_reservation_frees_everything(turns):
    checkpoint, first, second, _ = turns
    decode = make_engine(checkpoint, 64)
    decode.add_request(decode.make_request("t1", first, GREEDY))
    drain(decode)
    free = decode.kv_cache_manager.num_free_blocks
    request = decode.make_request("t2", second, GREEDY)
    reserved = decode.reserve_prefix(request, len(second) + 1)
    assert reserved.num_cached_blocks > 0
    assert decode.detach_reservation("t2") == reserved.block_ids
    decode.free_blocks(reserved.block_ids)
    assert decode.kv_cache_manager.num_free_blocks == free
    again = decode.reserve_prefix(decode.make_request("t2", second, GREEDY), len(second) + 1)
    assert again.num_cached_blocks == reserved.num_cached_blocks  # the hits were not lost
    assert decode.abort("t2")
    decode.check_no_leaks()


def test_a_short_pool_refuses_and_drops_its_hits(turns):
    checkpoint, first, second, _ = turns
    decode = make_engine(checkpoint, 10)
    decode.add_request(decode.make_request("t1", first[:30], GREEDY))
    drain(decode)
    hog = decode.reserve("hog", (decode.kv_cache_manager.num_free_blocks - 4) * BLOCK_SIZE)
    request = decode.make_request("t2", first[:30] + second[30:70], GREEDY)
    with pytest.raises(NoFreeBlocksError):
        decode.reserve_prefix(request, 71)
    assert decode.abort("hog") and hog
    decode.check_no_leaks()
