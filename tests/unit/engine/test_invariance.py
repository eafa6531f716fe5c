"""A request's tokens do not depend on what else runs with it or how the engine runs it."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.unit.engine.conftest import random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=10, ignore_eos=True)


def make_llm(checkpoint, **kwargs) -> LLM:
    kwargs.setdefault("num_blocks", 256)
    return LLM(str(checkpoint), device="cpu", dtype="float32", **kwargs)


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoints):
    return tiny_checkpoints["llama"]


@pytest.fixture(scope="module")
def targets():
    prompt_a, prompt_b = random_prompts(2, 512, seed=7, min_len=20, max_len=45)
    return [(prompt_a, GREEDY), (prompt_b, SEEDED)]


@pytest.fixture(scope="module")
def alone(checkpoint, targets):
    llm = make_llm(checkpoint)
    results = [llm.generate([p], params)[0].token_ids for p, params in targets]
    llm.engine.check_no_leaks()
    return results


def mixed_batch(targets, num_others: int = 14):
    """The targets at positions 3 and 11 among other greedy, seeded and unseeded requests."""
    others = random_prompts(num_others, 512, seed=99, min_len=2, max_len=60)
    kinds = [
        SamplingParams(temperature=0.0, max_tokens=7),
        SamplingParams(temperature=0.8, max_tokens=13),
        SamplingParams(temperature=1.0, top_k=20, seed=5, max_tokens=9, presence_penalty=0.5),
    ]
    prompts = [(p, kinds[i % len(kinds)]) for i, p in enumerate(others)]
    prompts.insert(3, targets[0])
    prompts.insert(11, targets[1])
    return prompts


def run_batch(llm: LLM, batch):
    outs = llm.generate([p for p, _ in batch], [params for _, params in batch])
    llm.engine.check_no_leaks()
    return [outs[3].token_ids, outs[11].token_ids]


def test_alone_equals_in_batch_of_16(checkpoint, targets, alone):
    batch = mixed_batch(targets)
    assert len(batch) == 16
    assert run_batch(make_llm(checkpoint), batch) == alone


@pytest.mark.parametrize("budget", [8, 24])
def test_chunked_prefill_sizes(checkpoint, targets, alone, budget):
    llm = make_llm(checkpoint, max_num_batched_tokens=budget)
    assert run_batch(llm, mixed_batch(targets)) == alone


def test_prefix_caching_on_and_off(checkpoint):
    shared = random_prompts(1, 512, seed=3, min_len=40, max_len=40)[0]
    prompts = [shared + tail for tail in random_prompts(4, 512, seed=4, min_len=1, max_len=9)]
    results = {}
    for enabled in (False, True):
        llm = make_llm(checkpoint, enable_prefix_caching=enabled)
        first = llm.generate(prompts[:1], GREEDY)  # fills the cache
        rest = llm.generate(prompts[1:], [GREEDY, SEEDED, GREEDY])
        outs = first + rest
        results[enabled] = [o.token_ids for o in outs]
        hits = [o.num_cached_tokens for o in rest]
        if enabled:
            assert all(h >= 32 for h in hits), f"expected prefix-cache hits, got {hits}"
            assert llm.engine.stats().prefix_cache_hit_tokens >= 3 * 32
        else:
            assert hits == [0, 0, 0]
        llm.engine.check_no_leaks()
    assert results[True] == results[False]


def test_forced_preemption(checkpoint, targets, alone):
    # 12 blocks of 16 tokens cannot hold 16 requests of up to ~70 tokens: preemption must occur.
    llm = make_llm(checkpoint, num_blocks=12)
    assert run_batch(llm, mixed_batch(targets)) == alone
    assert llm.engine.scheduler.num_preemptions > 0
