"""The hand-off API phase B builds on: a decode engine admits a request prefilled elsewhere
with its first token and draft tokens proposed after it (`add_prefilled(..., draft_token_ids)`);
its first step verifies them. Right or wrong drafts, the tokens are the single engine's."""

from __future__ import annotations

import pytest

from engine.engine_core import EngineCore
from engine.request import Request
from engine.spec_decode.handoff_drafts import checked_drafts, first_drafts
from pdserve.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from pdserve.sampling_params import SamplingParams
from tests.unit.engine.conftest import random_prompts


def make_engine(checkpoint, prefill_only: bool = False, **spec) -> EngineCore:
    return EngineCore(
        EngineConfig(
            model=ModelConfig(model=str(checkpoint), device="cpu", dtype="float32"),
            cache=CacheConfig(num_blocks=64),
            scheduler=SchedulerConfig(prefill_only=prefill_only),
            speculative=SpeculativeConfig(**spec),
        )
    )


def drain(engine: EngineCore) -> list[int]:
    tokens: list[int] = []
    for _ in range(200):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            tokens.extend(out.new_token_ids)
    return tokens


@pytest.mark.parametrize("drafts", ["right", "wrong"])
@pytest.mark.parametrize("decode_spec", ["ngram", "draft-self"])
def test_handed_in_drafts_verify_on_the_first_decode_step(tiny_checkpoints, drafts, decode_spec):
    checkpoint = tiny_checkpoints["llama"]
    prompt = random_prompts(1, 512, seed=8, min_len=20, max_len=20)[0] * 3
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    single = make_engine(checkpoint)
    single.add_request(single.make_request("r", prompt, params))
    expected = drain(single)

    spec = dict(speculative_method="ngram") if decode_spec == "ngram" else dict(
        speculative_method="draft", speculative_model=str(checkpoint)
    )  # fmt: skip
    prefill = make_engine(checkpoint, prefill_only=True, **spec)
    decode = make_engine(checkpoint, **spec)
    dst_block_ids = decode.reserve("r", len(prompt) + 1)
    prefill.add_request(prefill.make_request("r", prompt, params))
    (first_token,) = drain(prefill)
    held = prefill.get_request("r")
    assert held is not None
    num_blocks = -(-len(prompt) // prefill.pool.block_size)
    for (src_k, src_v), (dst_k, dst_v) in zip(prefill.pool.kv_caches, decode.pool.kv_caches):
        dst_k[dst_block_ids[:num_blocks]] = src_k[held.block_ids[:num_blocks]]
        dst_v[dst_block_ids[:num_blocks]] = src_v[held.block_ids[:num_blocks]]
    prefill.release("r")
    prefill.check_no_leaks()

    # right: the tokens that follow (all accepted); wrong: none accepted
    handed = expected[1:5] if drafts == "right" else [0, 0, 0]
    request = decode.make_request("r", prompt, params)
    decode.add_prefilled(request, dst_block_ids, first_token, draft_token_ids=handed)
    out = decode.step()  # the first step verifies the handed-in drafts
    stats = decode.stats().spec_decode
    assert stats.num_draft_tokens == len(handed)
    assert stats.num_accepted_tokens == (len(handed) if drafts == "right" else 0)
    rest = [t for o in out for t in o.new_token_ids] + drain(decode)
    assert [first_token] + rest == expected
    decode.check_no_leaks()


def test_first_drafts_are_the_prompt_lookup_after_the_first_token() -> None:
    """What a prefill node sends (spec_decode/handoff_drafts.py): the n-gram lookup over the
    prompt and the first token, capped by K and max_tokens; none when not speculating."""
    config = SpeculativeConfig(speculative_method="ngram", num_speculative_tokens=3)
    prompt = [5, 6, 7, 8, 9, 10, 11, 5, 6]
    request = Request("r", prompt, SamplingParams(temperature=0.0, max_tokens=20), (2,))
    assert first_drafts(config, request, 7) == [8, 9, 10]  # "5 6 7" seen: what followed it
    assert first_drafts(config, request, 42) == []  # no match
    assert first_drafts(config, request, 2) == []  # the first token is EOS: nothing follows
    short = Request("s", prompt, SamplingParams(temperature=0.0, max_tokens=3), (2,))
    assert first_drafts(config, short, 7) == [8]  # two tokens left: one draft + the target's
    opted_out = Request("o", prompt, SamplingParams(max_tokens=20, speculative=False))
    assert first_drafts(config, opted_out, 7) == []
    assert first_drafts(SpeculativeConfig(), request, 7) == []  # speculation off
    draft_model = SpeculativeConfig(speculative_method="draft", speculative_model="x")
    assert first_drafts(draft_model, request, 7) == []  # its KV hand-off is not built


def test_handed_in_drafts_are_checked(tiny_checkpoints) -> None:
    """At most K are kept; any id outside the vocabulary drops them all (drafts are hints)."""
    decode = make_engine(tiny_checkpoints["llama"], speculative_method="ngram")
    assert decode.spec is not None
    k, vocab = decode.spec.num_speculative_tokens, decode.arch.vocab_size
    assert checked_drafts(list(range(1, 30)), decode.spec, decode.arch) == list(range(1, k + 1))
    assert checked_drafts([1, vocab], decode.spec, decode.arch) == []
    assert checked_drafts([1, -1], decode.spec, decode.arch) == []
