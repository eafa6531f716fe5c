"""KV computed by a prefill-only engine, copied into another engine's reserved blocks with the
first token, continues to exactly the tokens of a single-engine run."""

from __future__ import annotations

import pytest

from engine.engine_core import EngineCore
from pdserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pdserve.sampling_params import SamplingParams
from tests.unit.engine.conftest import random_prompts


def make_engine(checkpoint, num_blocks: int, prefill_only: bool = False, hook=None) -> EngineCore:
    config = EngineConfig(
        model=ModelConfig(model=str(checkpoint), device="cpu", dtype="float32"),
        cache=CacheConfig(num_blocks=num_blocks),
        scheduler=SchedulerConfig(prefill_only=prefill_only, max_num_batched_tokens=32),
    )
    return EngineCore(config, on_layer_done=hook)


def run_to_completion(engine: EngineCore, request_ids: set[str]) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {rid: [] for rid in request_ids}
    for _ in range(1000):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
    assert not engine.has_unfinished()
    return tokens


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=42, max_tokens=12, ignore_eos=True),
    ],
    ids=["greedy", "seeded"],
)
def test_prefill_decode_handoff(tiny_checkpoints, params):
    checkpoint = tiny_checkpoints["qwen3"]
    prompt = random_prompts(1, 512, seed=11, min_len=70, max_len=70)[0]

    single = make_engine(checkpoint, num_blocks=64)
    single.add_request(single.make_request("r", prompt, params))
    expected = run_to_completion(single, {"r"})["r"]

    layers_done: list[int] = []
    prefill = make_engine(
        checkpoint,
        num_blocks=40,
        prefill_only=True,
        hook=lambda layer, chunks: layers_done.append(layer),
    )
    decode = make_engine(checkpoint, num_blocks=80)

    # Decode side first: take some blocks so the reservation's ids differ from the prefill's.
    decoy = decode.reserve("decoy", 50)
    dst_block_ids = decode.reserve("r", len(prompt) + 1)

    prefill.add_request(prefill.make_request("r", prompt, params))
    first_token = None
    for _ in range(100):
        outs = prefill.step()
        done = [o for o in outs if o.prefill_done]
        if done:
            (first_token,) = done[0].new_token_ids
            break
    assert first_token is not None
    held = prefill.get_request("r")
    src_block_ids = list(held.block_ids)
    assert src_block_ids != dst_block_ids[: len(src_block_ids)]
    # the hook saw every layer, in order, once per prefill step (70 tokens / 32 budget = 3)
    num_layers = prefill.arch.num_layers
    assert layers_done == list(range(num_layers)) * 3

    num_blocks = -(-len(prompt) // prefill.pool.block_size)
    for (src_k, src_v), (dst_k, dst_v) in zip(prefill.pool.kv_caches, decode.pool.kv_caches):
        dst_k[dst_block_ids[:num_blocks]] = src_k[src_block_ids[:num_blocks]]
        dst_v[dst_block_ids[:num_blocks]] = src_v[src_block_ids[:num_blocks]]
    prefill.release("r")
    prefill.check_no_leaks()

    decode.add_prefilled(decode.make_request("r", prompt, params), dst_block_ids, first_token)
    rest = run_to_completion(decode, {"r"})["r"]
    assert [first_token] + rest == expected
    decode.abort("decoy")
    assert decoy
    decode.check_no_leaks()


def test_add_prefilled_refuses_unreserved_blocks(tiny_checkpoints):
    from pdserve.sampling_params import InvalidRequestError

    engine = make_engine(tiny_checkpoints["llama"], num_blocks=16)
    request = engine.make_request("x", [5, 6, 7], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="not reserved"):
        engine.add_prefilled(request, [0], first_token=9)
    engine.check_no_leaks()
