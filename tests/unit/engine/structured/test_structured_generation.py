"""Structured outputs on the default model (SmolLM2-135M, its real tokenizer), CPU: every
output of the corpus' 24 JSON schemas validates, greedy and seeded, alone in one batch; regex,
choice and grammar outputs match; async scheduling, a prefill -> decode hand-off and a
migration give the tokens of one plain run; nothing leaks."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from engine.engine_core import EngineCore
from engine.structured import CompiledGrammar
from pdserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pdserve.sampling_params import SamplingParams
from pdserve.structured_output import StructuredOutputParams
from tests.unit.engine.structured.conftest import corpus

pytestmark = pytest.mark.slow

MAX_TOKENS = 160  # every corpus schema is bounded: outputs end well before
SEED = 1234
# The corpus grammars as Python regexes (the Lark text is what the engine compiles).
GRAMMAR_REGEXES = {
    "arithmetic": r"[0-9]{1,3}([+-][0-9]{1,3}){0,3}",
    "greeting": r"Hello, [A-Z][a-z]{1,10}!",
}


def make_engine(**scheduler) -> EngineCore:
    config = EngineConfig(
        model=ModelConfig(model="smollm2-135m", device="cpu", dtype="float32"),
        cache=CacheConfig(num_blocks=512),
        scheduler=SchedulerConfig(**scheduler),
    )
    return EngineCore(config)


@pytest.fixture(scope="module")
def engine() -> EngineCore:
    return make_engine()


def prompt_ids(tokenizer, task: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": task}])
    return tokenizer.encode(text, add_special_tokens=False)


def params_for(spec: StructuredOutputParams, greedy: bool) -> SamplingParams:
    if greedy:
        return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, structured_output=spec)
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=SEED, structured_output=spec)


def generate(engine: EngineCore, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    """request_id -> (token ids, finish reason), all in one continuous batch."""
    for request_id, (prompt, params) in requests.items():
        grammar = engine.structured.compile(params)
        engine.add_request(engine.make_request(request_id, prompt, params, grammar=grammar))
    results: dict[str, tuple[list[int], str | None]] = {rid: ([], None) for rid in requests}
    for _ in range(10 * MAX_TOKENS):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            tokens, _ = results[out.request_id]
            tokens.extend(out.new_token_ids)
            results[out.request_id] = (tokens, out.finish_reason)
    assert not engine.has_unfinished()
    engine.check_no_leaks()
    return results


def text_of(tokenizer, token_ids: list[int]) -> str:
    return tokenizer.decode(token_ids, skip_special_tokens=True)


def test_every_schema_output_validates(engine, smollm2_tokenizer):
    schemas = corpus()["json_schemas"]
    assert len(schemas) >= 20
    requests = {}
    for name, schema in schemas.items():
        prompt = prompt_ids(smollm2_tokenizer, f"Reply with JSON for: {name.replace('_', ' ')}.")
        for greedy in (True, False):
            spec = StructuredOutputParams.json_schema(schema)
            requests[f"{name}/{'greedy' if greedy else 'seeded'}"] = (
                prompt,
                params_for(spec, greedy),
            )
    results = generate(engine, requests)
    for request_id, (tokens, finish_reason) in results.items():
        text = text_of(smollm2_tokenizer, tokens)
        assert finish_reason == "stop", (request_id, text)
        jsonschema.validate(json.loads(text), schemas[request_id.split("/")[0]])


def test_regex_choice_and_grammar_outputs_match(engine, smollm2_tokenizer):
    doc = corpus()
    cases = {f"regex/{n}": (StructuredOutputParams.regex(r), r) for n, r in doc["regexes"].items()}
    cases |= {
        f"choice/{n}": (StructuredOutputParams.choice(c), "|".join(map(re.escape, c)))
        for n, c in doc["choices"].items()
    }
    cases |= {
        f"grammar/{n}": (StructuredOutputParams.grammar(g), GRAMMAR_REGEXES[n])
        for n, g in doc["grammars"].items()
    }
    cases["json_object"] = (StructuredOutputParams.json_object(), None)
    prompt = prompt_ids(smollm2_tokenizer, "Answer briefly.")
    requests = {
        f"{name}/{greedy}": (prompt, params_for(spec, greedy))
        for name, (spec, _) in cases.items()
        for greedy in (True, False)
    }
    for request_id, (tokens, finish_reason) in generate(engine, requests).items():
        text = text_of(smollm2_tokenizer, tokens)
        assert finish_reason == "stop", (request_id, text)
        pattern = cases[request_id.rsplit("/", 1)[0]][1]
        if pattern is None:
            assert isinstance(json.loads(text), dict)
        else:
            assert re.fullmatch(pattern, text), (request_id, text)


def constrained_requests(tokenizer, names: list[str], modes=(True, False)) -> dict:
    schemas = corpus()["json_schemas"]
    prompt = prompt_ids(tokenizer, "Reply with JSON.")
    return {
        f"{name}/{greedy}": (
            prompt,
            params_for(StructuredOutputParams.json_schema(schemas[name]), greedy),
        )
        for name in names
        for greedy in modes
    }


def test_async_scheduling_gives_the_synchronous_tokens(engine, smollm2_tokenizer):
    requests = constrained_requests(smollm2_tokenizer, ["person", "enum_color"])
    free = SamplingParams(max_tokens=12, seed=SEED)  # unconstrained, seeded: comparable
    requests["free"] = (prompt_ids(smollm2_tokenizer, "Hi"), free)
    expected = generate(engine, requests)
    ahead = make_engine(async_scheduling="on")
    deferred = []
    sample_deferred = ahead.runner.sample_deferred
    ahead.runner.sample_deferred = lambda step: (deferred.append(step), sample_deferred(step))
    assert generate(ahead, requests) == expected
    assert ahead.num_steps_ahead > 0 and deferred  # constrained steps sampled after the wait


def first_token_of(prefill: EngineCore, request_id: str) -> int:
    for _ in range(100):
        done = [o for o in prefill.step() if o.prefill_done or o.finished]
        if done:
            (token,) = done[0].new_token_ids
            return token
    raise AssertionError("the prefill never finished")


def test_prefill_decode_handoff_continues_under_the_grammar(engine, smollm2_tokenizer):
    ((request_id, (prompt, params)),) = constrained_requests(
        smollm2_tokenizer, ["nested_address"], modes=(False,)
    ).items()
    expected, _ = generate(engine, {request_id: (prompt, params)})[request_id]
    prefill = make_engine(prefill_only=True, max_num_batched_tokens=16)
    grammar = prefill.structured.compile(params)
    prefill.add_request(prefill.make_request(request_id, prompt, params, grammar=grammar))
    first_token = first_token_of(prefill, request_id)  # sampled under the grammar
    assert first_token == expected[0]

    decode = make_engine()
    dst_block_ids = decode.reserve(request_id, len(prompt) + 1)
    src_block_ids = prefill.get_request(request_id).block_ids
    num_blocks = -(-len(prompt) // prefill.pool.block_size)
    for (src_k, src_v), (dst_k, dst_v) in zip(prefill.pool.kv_caches, decode.pool.kv_caches):
        dst_k[dst_block_ids[:num_blocks]] = src_k[src_block_ids[:num_blocks]]
        dst_v[dst_block_ids[:num_blocks]] = src_v[src_block_ids[:num_blocks]]
    prefill.release(request_id)
    prefill.check_no_leaks()
    request = decode.make_request(
        request_id, prompt, params, grammar=decode.structured.compile(params)
    )
    decode.add_prefilled(request, dst_block_ids, first_token)  # its matcher takes the token
    assert request.matcher.num_accepted_tokens == 1
    rest = []
    while decode.has_unfinished():
        for out in decode.step():
            rest.extend(out.new_token_ids)
    assert [first_token, *rest] == expected
    decode.check_no_leaks()


def test_a_migrated_request_continues_from_its_tokens(engine, smollm2_tokenizer):
    requests = constrained_requests(smollm2_tokenizer, ["product"], modes=(True,))
    expected = generate(engine, requests)
    for request_id, (prompt, params) in requests.items():
        tokens, _ = expected[request_id]
        request = engine.make_request(request_id, prompt, params)  # the cached grammar
        request.output_token_ids = tokens[:5]  # streamed by a node that died
        engine.add_request(request)
        assert request.matcher.num_accepted_tokens == 5
        rest = []
        while engine.has_unfinished():
            for out in engine.step():
                rest.extend(out.new_token_ids)
        assert tokens[:5] + rest == tokens
    engine.check_no_leaks()


def test_a_request_needs_its_grammar_compiled(engine):
    params = SamplingParams(structured_output=StructuredOutputParams.regex("never-compiled"))
    with pytest.raises(ValueError, match="not compiled"):
        engine.make_request("x", [1, 2, 3], params)
    assert isinstance(engine.structured.compile(params), CompiledGrammar)
    engine.make_request("x", [1, 2, 3], params)  # from the cache now
