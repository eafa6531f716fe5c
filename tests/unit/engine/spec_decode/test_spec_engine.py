"""Speculative decoding through the whole engine on tiny models (CPU, float32): greedy and
seeded requests give the tokens, finish reasons and logprobs of the engine without it, with
the n-gram proposer and with draft models (the target drafting for itself: every greedy draft
accepted, so stops land inside accepted runs; a smaller random model: most rejected), through
chunked prefill, preemption, prefix hits and async scheduling; nothing leaks."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.unit.engine.conftest import random_prompts

VOCAB = 512


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoints) -> str:
    return str(tiny_checkpoints["llama"])


def make_llm(checkpoint: str, **kwargs) -> LLM:
    kwargs.setdefault("num_blocks", 256)
    return LLM(checkpoint, device="cpu", dtype="float32", **kwargs)


def proposers(checkpoint: str) -> dict[str, dict]:
    return {
        "ngram": dict(
            speculative_method="ngram", num_speculative_tokens=4, ngram_prompt_lookup_min=1
        ),
        "draft-self": dict(speculative_method="draft", speculative_model=checkpoint),
        "draft-small": dict(
            speculative_method="draft",
            speculative_model="synthetic:tiny-llama:layers=1",
            num_speculative_tokens=3,
        ),  # fmt: skip
    }


def workload(stop_token: int):
    """Greedy and seeded requests of every kind the sampler handles (top-p/top-k, min_tokens
    with a stop token, logprobs, the three penalties over the drafts, max_tokens of 1 and 2),
    plus unseeded ones (run, not compared); some prompts repeat themselves, so that prompt
    lookup finds matches."""
    kinds = [
        SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True),
        SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=9, logprobs=3),
        SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[stop_token]),
        SamplingParams(
            temperature=0.8,
            top_k=20,
            seed=3,
            max_tokens=12,
            min_tokens=6,
            stop_token_ids=[stop_token],
        ),  # fmt: skip
        SamplingParams(temperature=1.0, seed=5, max_tokens=8, presence_penalty=0.5),
        SamplingParams(temperature=0.0, max_tokens=9, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(temperature=0.7, seed=8, max_tokens=10, frequency_penalty=0.8),
        SamplingParams(temperature=0.0, max_tokens=1),
        SamplingParams(temperature=0.0, max_tokens=2, logprobs=2),
        SamplingParams(temperature=0.9, max_tokens=10),  # unseeded: not compared
        SamplingParams(temperature=0.0, max_tokens=12, logprobs=1, speculative=False),
    ]
    prompts = random_prompts(16, VOCAB, seed=21, min_len=2, max_len=30)
    prompts = [p * 3 if i % 2 else p for i, p in enumerate(prompts)]
    return prompts, [kinds[i % len(kinds)] for i in range(len(prompts))]


def run(llm: LLM, prompts, params):
    """Each compared request's (tokens, finish reason, logprob ids and ranks), and apart its
    logprob values (a verify step computes them in another order: float32 noise)."""
    outs = llm.generate(prompts, params)
    llm.engine.check_no_leaks()
    exact, values = [], []
    for o, p in zip(outs, params):
        if not (p.greedy or p.seed is not None):
            continue
        lps = o.logprobs or []
        exact.append((o.token_ids, o.finish_reason,
                      [(lp.token_id, lp.rank, [t for t, _ in lp.top]) for lp in lps]))  # fmt: skip
        values += [v for lp in lps for v in (lp.logprob, *(v for _, v in lp.top))]
    return exact, values


@pytest.fixture(scope="module")
def stop_token(checkpoint) -> int:
    """A token a greedy request really produces mid-output, so stop_token_ids fire."""
    prompts, _ = workload(stop_token=0)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    return make_llm(checkpoint).generate(prompts[2], greedy)[0].token_ids[3]


VARIANTS = {
    "default": {},
    "chunked": {"max_num_batched_tokens": 8},  # chunks between verifies, drafts cut by budget
    "preemption": {"num_blocks": 7},  # the pool cannot hold the batch
    "async": {"async_scheduling": "on", "max_num_seqs": 4},  # falls back to synchronous steps
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("proposer", ["ngram", "draft-self", "draft-small"])
def test_speculation_gives_the_tokens_of_the_plain_engine(
    checkpoint, stop_token, proposer, variant
):
    prompts, params = workload(stop_token)
    engine_kwargs = VARIANTS[variant]
    expected, expected_values = run(make_llm(checkpoint, **engine_kwargs), prompts, params)
    llm = make_llm(checkpoint, **engine_kwargs, **proposers(checkpoint)[proposer])
    got, values = run(llm, prompts, params)
    assert got == expected
    assert values == pytest.approx(expected_values, abs=1e-4) and values
    stats = llm.engine.stats().spec_decode
    assert stats.num_verifies > 0 and stats.num_draft_tokens > 0
    if proposer != "draft-small":  # (a random one-layer model: its drafts may all miss)
        assert stats.num_accepted_tokens > 0
    if variant == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0
    assert any(o[1] == "stop" for o in expected), "no request stopped on a token"


@pytest.mark.parametrize("proposer", ["ngram", "draft-self"])
def test_prefix_hits_under_speculation(checkpoint, proposer):
    """Blocks filled by verify steps serve later requests' prefix hits (the draft model's KV
    with them) and give the tokens of the plain engine."""
    shared = random_prompts(1, VOCAB, seed=3, min_len=20, max_len=20)[0] * 2
    tails = random_prompts(4, VOCAB, seed=4, min_len=1, max_len=9)
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    results = {}
    for name, kwargs in (("plain", {}), (proposer, proposers(checkpoint)[proposer])):
        llm = make_llm(checkpoint, **kwargs)
        first = llm.generate([shared + tails[0]], greedy)
        # the next prompts extend the first request's prompt + output: verified blocks hit
        grown = shared + tails[0] + first[0].token_ids
        rest = llm.generate([grown + t for t in tails[1:]], greedy)
        assert all(o.num_cached_tokens >= len(grown) - 16 for o in rest)
        results[name] = [o.token_ids for o in first + rest]
        llm.engine.check_no_leaks()
    assert results[proposer] == results["plain"]


def test_a_model_drafting_for_itself_is_always_right_under_greedy(checkpoint, stop_token):
    """Every greedy draft is accepted, so the stop token and max_tokens land inside accepted
    runs: the request ends there, the tokens after it dropped, as without speculation."""
    prompts, _ = workload(stop_token)
    params = [
        SamplingParams(temperature=0.0, max_tokens=4 + i % 13, stop_token_ids=[stop_token])
        for i in range(len(prompts))
    ]
    expected, _ = run(make_llm(checkpoint), prompts, params)
    llm = make_llm(checkpoint, **proposers(checkpoint)["draft-self"])
    got, _ = run(llm, prompts, params)
    assert got == expected
    stats = llm.engine.stats().spec_decode
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0
    assert stats.num_emitted_tokens < stats.num_accepted_tokens + stats.num_verifies, (
        "no stop landed inside an accepted run"
    )
    assert any(o[1] == "stop" for o in expected)


def test_a_draft_model_with_another_vocabulary_is_refused(checkpoint):
    with pytest.raises(ValueError, match="vocabulary has 1024 tokens but the model's has 512"):
        make_llm(
            checkpoint, speculative_method="draft",
            speculative_model="synthetic:tiny-llama:vocab=1024",
        )  # fmt: skip
