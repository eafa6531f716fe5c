"""Async scheduling (step n+1 chosen and launched before step n's tokens are on the host) gives
exactly the tokens, logprobs and finish reasons of the synchronous engine, frees nothing a
launched step still writes, and leaks nothing. On CPU it only reorders work, which is what
these tests need: the same code path as on CUDA, where it hides the host's work."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.engine_core import EngineCore
from engine.scheduler_output import PENDING
from pdserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tests.unit.engine.conftest import random_prompts

VOCAB = 512


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoints):
    return tiny_checkpoints["llama"]


def make_llm(checkpoint, mode: str, **kwargs) -> LLM:
    kwargs.setdefault("num_blocks", 256)
    return LLM(str(checkpoint), device="cpu", dtype="float32", async_scheduling=mode, **kwargs)


def workload(stop_token: int):
    """16 requests of every kind the sampler and scheduler handle: greedy, seeded top-p/top-k,
    min_tokens with a stop token, logprobs, the three penalties (their pending token counted
    on the device), EOS on,
    varied max_tokens; plus unseeded random ones, which run but are not compared (their noise
    comes from one draw per step, so it depends on how steps are composed)."""
    kinds = [
        SamplingParams(temperature=0.0, max_tokens=11, ignore_eos=True),
        SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=9, logprobs=3),
        SamplingParams(temperature=0.0, max_tokens=14, stop_token_ids=[stop_token]),
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
        SamplingParams(temperature=0.0, max_tokens=6, logprobs=2),
        SamplingParams(temperature=0.9, max_tokens=10),  # unseeded: not compared
    ]
    prompts = random_prompts(16, VOCAB, seed=21, min_len=2, max_len=50)
    return prompts, [kinds[i % len(kinds)] for i in range(len(prompts))]


def comparable(params: SamplingParams) -> bool:
    return params.greedy or params.seed is not None


def run(llm: LLM, prompts, params):
    """Each compared request's (tokens, finish reason, logprob ids and ranks) and, apart, its
    logprob values (which a different batch composition moves by float32 noise)."""
    outs = llm.generate(prompts, params)
    llm.engine.check_no_leaks()
    exact, values = [], []
    for o, p in zip(outs, params):
        if not comparable(p):
            continue
        lps = o.logprobs or []
        exact.append((o.token_ids, o.finish_reason,
                      [(lp.token_id, lp.rank, [t for t, _ in lp.top]) for lp in lps]))  # fmt: skip
        values += [v for lp in lps for v in (lp.logprob, *(v for _, v in lp.top))]
    return exact, values


@pytest.fixture(scope="module")
def stop_token(checkpoint) -> int:
    """A token the greedy requests really produce mid-output, so stop_token_ids fire."""
    llm = make_llm(checkpoint, "off")
    prompts, _ = workload(stop_token=0)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate(prompts[:4], greedy)
    return outs[2].token_ids[3]


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        {},
        {"max_num_batched_tokens": 8},  # chunked prefills between decodes
        {"num_blocks": 8},  # preemption (the pool cannot hold the batch)
        {"max_num_seqs": 4},  # a full running set, prompts waiting: decodes still go ahead
    ],
    ids=["default", "chunked", "preemption", "max-seqs-4"],
)
def test_async_scheduling_gives_the_tokens_of_the_synchronous_engine(
    checkpoint, stop_token, engine_kwargs
):
    prompts, params = workload(stop_token)
    expected, expected_values = run(make_llm(checkpoint, "off", **engine_kwargs), prompts, params)
    llm = make_llm(checkpoint, "on", **engine_kwargs)
    got, values = run(llm, prompts, params)
    assert got == expected
    assert values == pytest.approx(expected_values, abs=1e-4) and values
    assert llm.engine.num_steps_ahead > 0, "no step was scheduled ahead: nothing was tested"
    if "num_blocks" in engine_kwargs:
        assert llm.engine.scheduler.num_preemptions > 0
    stops = [o for o in expected if o[1] == "stop"]
    assert stops, "no request stopped on a token: the ahead step's drop was not tested"


def test_prefix_cache_hits_under_async_scheduling(checkpoint):
    shared = random_prompts(1, VOCAB, seed=3, min_len=40, max_len=40)[0]
    prompts = [shared + tail for tail in random_prompts(4, VOCAB, seed=4, min_len=1, max_len=9)]
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    results = {}
    for mode in ("off", "on"):
        llm = make_llm(checkpoint, mode)
        first = llm.generate(prompts[:1], greedy)
        rest = llm.generate(prompts[1:], greedy)
        assert all(o.num_cached_tokens >= 32 for o in rest)
        results[mode] = [o.token_ids for o in first + rest]
        llm.engine.check_no_leaks()
    assert results["on"] == results["off"]


def make_core(checkpoint, mode: str, num_blocks: int = 64, prefill_only: bool = False):
    return EngineCore(
        EngineConfig(
            model=ModelConfig(model=str(checkpoint), device="cpu", dtype="float32"),
            cache=CacheConfig(num_blocks=num_blocks),
            scheduler=SchedulerConfig(async_scheduling=mode, prefill_only=prefill_only),
        )
    )


def test_abort_of_a_request_in_a_launched_step_frees_its_blocks_after_that_step(checkpoint):
    core = make_core(checkpoint, "on")
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    # Prompts of 20 tokens: the next decodes stay inside their second block (no allocation).
    for rid, seed in (("a", 1), ("b", 2)):
        prompt = random_prompts(1, VOCAB, seed=seed, min_len=20, max_len=20)[0]
        core.add_request(core.make_request(rid, prompt, greedy))
    for _ in range(3):  # prefill, then decodes scheduled ahead
        core.step()
    assert core.num_steps_ahead > 0
    held = len(core.get_request("a").block_ids)
    free_before = core.kv_cache_manager.num_free_blocks
    assert core.abort("a")
    assert core.kv_cache_manager.num_free_blocks == free_before, (
        "blocks a launched step still writes were freed before it finished"
    )
    outputs = core.step()  # waits for the launched step (and launches b's next)
    assert "a" not in {o.request_id for o in outputs}, "an aborted request still produced output"
    assert core.kv_cache_manager.num_free_blocks == free_before + held
    core.abort("b")
    while core.has_unfinished():
        core.step()
    core.check_no_leaks()


def _prefill_into(prefill: EngineCore, decode: EngineCore, rid: str, prompt, params) -> int:
    """Prefill `prompt` on the prefill-only engine, copy its KV into blocks reserved on the
    decode engine, admit it there; returns its first token."""
    dst = decode.reserve(rid, len(prompt) + 1)
    prefill.add_request(prefill.make_request(rid, prompt, params))
    first = None
    while first is None:
        done = [o for o in prefill.step() if o.prefill_done]
        first = done[0].new_token_ids[0] if done else None
    src = prefill.get_request(rid).block_ids
    n = -(-len(prompt) // prefill.pool.block_size)
    for (src_k, src_v), (dst_k, dst_v) in zip(prefill.pool.kv_caches, decode.pool.kv_caches):
        dst_k[dst[:n]] = src_k[src[:n]]
        dst_v[dst[:n]] = src_v[src[:n]]
    prefill.release(rid)
    decode.add_prefilled(decode.make_request(rid, prompt, params), dst, first)
    return first


def test_decode_role_admits_prefilled_requests_between_steps_scheduled_ahead(checkpoint):
    """A request admitted with its first token (host-known) joins a step scheduled ahead next
    to requests whose inputs are still on the device."""
    prompts = random_prompts(3, VOCAB, seed=13, min_len=18, max_len=40)
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=9, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
    ]
    expected = [o.token_ids for o in make_llm(checkpoint, "off").generate(prompts, params)]

    prefill = make_core(checkpoint, "off", prefill_only=True)
    decode = make_core(checkpoint, "on")
    assert decode.async_scheduling and not prefill.async_scheduling
    tokens: dict[str, list[int]] = {}
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        tokens[str(i)] = [_prefill_into(prefill, decode, str(i), prompt, p)]
        for _ in range(2):  # the next request arrives while steps run ahead
            for out in decode.step():
                tokens[out.request_id] += out.new_token_ids
    while decode.has_unfinished():
        for out in decode.step():
            tokens[out.request_id] += out.new_token_ids
    assert [tokens[str(i)] for i in range(3)] == expected
    assert decode.num_steps_ahead > 0
    decode.check_no_leaks()
    prefill.check_no_leaks()


def test_auto_is_off_on_cpu_and_for_the_prefill_role(checkpoint):
    assert not make_core(checkpoint, "auto").async_scheduling
    assert not make_core(checkpoint, "on", prefill_only=True).async_scheduling
    assert make_core(checkpoint, "on").async_scheduling


def record_steps_scheduled_ahead(llm: LLM) -> list:
    """Every SchedulerOutput (or None) the engine's schedule_ahead returns from now on."""
    chosen: list = []
    schedule_ahead = llm.engine.scheduler.schedule_ahead

    def recorded():
        output = schedule_ahead()
        chosen.append(output)
        return output

    llm.engine.scheduler.schedule_ahead = recorded
    return chosen


def test_prompts_are_admitted_and_chunked_in_steps_scheduled_ahead(checkpoint):
    """Ahead steps are not only steady decodes: waiting prompts are admitted and chunked
    prefills continue in them, next to decodes whose inputs are still on the device."""
    llm = make_llm(checkpoint, "on", max_num_batched_tokens=8, max_num_seqs=6)
    chosen = record_steps_scheduled_ahead(llm)
    prompts = random_prompts(12, VOCAB, seed=5, min_len=3, max_len=30)
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    llm.engine.check_no_leaks()
    steps = [o for o in chosen if o is not None]
    mixed = [
        o for o in steps
        if any(c.is_prefill for c in o.chunks) and any(c.token_ids == [PENDING] for c in o.chunks)
    ]  # fmt: skip
    assert mixed, "no step scheduled ahead held both a prompt chunk and a pending decode"


def test_requests_with_penalties_decode_ahead_with_the_pending_token_counted(checkpoint):
    """A penalty reads the whole output: the token still pending on the device is counted
    there, so the request decodes ahead and samples what the synchronous engine samples."""
    prompts = random_prompts(4, VOCAB, seed=17, min_len=5, max_len=25)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                            repetition_penalty=1.5, frequency_penalty=1.0, presence_penalty=0.5)  # fmt: skip
    expected = [o.token_ids for o in make_llm(checkpoint, "off").generate(prompts, params)]
    llm = make_llm(checkpoint, "on")
    chosen = record_steps_scheduled_ahead(llm)
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    llm.engine.check_no_leaks()
    pending_decodes = [
        c for o in chosen if o is not None for c in o.chunks if c.token_ids == [PENDING]
    ]
    assert pending_decodes and all(c.request.sampling_params.has_penalties for c in pending_decodes)
