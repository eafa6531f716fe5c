"""Structured outputs served end to end (issue 37, acceptance 1-2): the default model behind a
real pd-serve, colocated (one decode node prefills) and 1P1D (every prompt handed off), asked
through the official `openai` client:

- every JSON schema of the corpus (24), greedy and seeded, gives output that parses and
  validates with `jsonschema`; regex and choice outputs match; greedy outputs are identical
  colocated and 1P1D;
- `client.chat.completions.parse(response_format=<pydantic model>)` returns a parsed object;
- hostile specs get a 400 naming the problem within the compile time limit while a plain
  request on the same server is answered.
"""

from __future__ import annotations

import asyncio
import json
import re
import time

import jsonschema
import openai
import pydantic
import pytest

from tests.e2e.conftest import MODEL, _cluster
from tests.e2e.observe import http_url
from tests.ports import free_port
from tests.unit.engine.structured.conftest import corpus

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MAX_TOKENS = 160  # the corpus schemas are bounded: outputs end well before
SEED = 1234
TIMEOUT_S = 600.0
MODES = ("colocated", "1p1d")
ROLES = {
    "colocated": ("--prefill", "0", "--decode", "1"),
    "1p1d": ("--prefill", "1", "--decode", "1"),
}


@pytest.fixture(scope="module")
def clients():
    """mode -> the /v1 URL of its own pd-serve (started one after the other)."""
    clusters, out = [], {}
    try:
        for mode in MODES:
            gen = _cluster(*ROLES[mode], port_flags=lambda: ["--http-port", str(free_port())])
            cluster = next(gen)
            clusters.append(gen)
            out[mode] = f"{http_url(cluster)}/v1"
        yield out
    finally:
        for gen in clusters:
            next(gen, None)  # stops it, asserting nothing was left behind


def run(main, urls: dict[str, str]):
    """`main(clients)` on a fresh loop, with an AsyncOpenAI client per mode made on it."""

    async def with_clients():
        clients = {mode: openai.AsyncOpenAI(base_url=url, api_key="unused", timeout=TIMEOUT_S,
                                            max_retries=0) for mode, url in urls.items()}  # fmt: skip
        try:
            return await main(clients)
        finally:
            for client in clients.values():
                await client.close()

    return asyncio.run(asyncio.wait_for(with_clients(), TIMEOUT_S))


def schema_format(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


async def ask(client, task: str, greedy: bool, **kwargs) -> tuple[str, str]:
    sampling = {"temperature": 0.0} if greedy else {"temperature": 0.8, "seed": SEED}
    response = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": task}], max_tokens=MAX_TOKENS,
        **sampling, **kwargs,
    )  # fmt: skip
    choice = response.choices[0]
    return choice.message.content, choice.finish_reason


@pytest.fixture(scope="module")
def schema_outputs(clients) -> dict:
    """(mode, schema name, greedy) -> (text, finish_reason), every request of a mode at once."""
    schemas = corpus()["json_schemas"]
    keys = [(mode, name, greedy) for mode in MODES for name in schemas for greedy in (True, False)]

    async def main(clients):
        return await asyncio.gather(*(
            ask(clients[mode], f"Reply with JSON for: {name.replace('_', ' ')}.", greedy,
                response_format=schema_format(name, schemas[name]))
            for mode, name, greedy in keys
        ))  # fmt: skip

    return dict(zip(keys, run(main, clients)))


def test_every_schema_output_validates(schema_outputs) -> None:
    schemas = corpus()["json_schemas"]
    assert len(schemas) >= 20
    for (mode, name, greedy), (text, finish_reason) in schema_outputs.items():
        assert finish_reason == "stop", (mode, name, greedy, text)
        jsonschema.validate(json.loads(text), schemas[name])


def test_greedy_outputs_are_identical_colocated_and_1p1d(schema_outputs) -> None:
    for name in corpus()["json_schemas"]:
        assert schema_outputs["colocated", name, True] == schema_outputs["1p1d", name, True], name


def test_regex_and_choice_outputs_match(clients) -> None:
    doc = corpus()
    cases = [(f"regex/{n}", {"guided_regex": r}, r) for n, r in doc["regexes"].items()]
    cases += [
        (f"choice/{n}", {"structured_outputs": {"choice": c}}, "|".join(map(re.escape, c)))
        for n, c in doc["choices"].items()
    ]

    async def main(clients):
        return await asyncio.gather(*(
            ask(clients[mode], "Answer briefly.", greedy, extra_body=body)
            for mode in MODES for _, body, _ in cases for greedy in (True, False)
        ))  # fmt: skip

    results = iter(run(main, clients))
    for mode in MODES:
        for name, _, pattern in cases:
            for greedy in (True, False):
                text, finish_reason = next(results)
                assert finish_reason == "stop", (mode, name, greedy, text)
                assert re.fullmatch(pattern, text), (mode, name, greedy, text)


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    country: str = pydantic.Field(max_length=20)
    population_millions: int = pydantic.Field(ge=0, le=50)


@pytest.mark.parametrize("mode", MODES)
def test_openai_parse_with_a_pydantic_model(clients, mode) -> None:
    async def main(clients):
        return await clients[mode].chat.completions.parse(
            model=MODEL, messages=[{"role": "user", "content": "Describe Paris as JSON."}],
            response_format=City, max_tokens=MAX_TOKENS, temperature=0.0,
        )  # fmt: skip

    completion = run(main, clients)
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, City), completion.choices[0].message.content
    assert completion.choices[0].finish_reason == "stop"


HOSTILE = {
    "deep nesting": (
        {"guided_json": '{"type":"object","properties":{"a":' * 3000 + "{}" + "}}" * 3000},
        "nests deeper",
    ),
    "huge enum": ({"guided_json": {"enum": list(range(200_000))}}, "bytes"),
    "regex repeat bomb": ({"guided_regex": "((x{1000}){1000}){1000}"}, "repetitions"),
    "invalid regex": ({"guided_regex": "(unclosed[a-"}, "structured output"),
    "unknown $ref": ({"guided_json": {"$ref": "#/$defs/nothing"}}, "structured output"),
    "lark syntax": ({"guided_grammar": "start: ( unbalanced\n"}, "structured output"),
}


def test_hostile_specs_are_400s_while_the_server_answers(clients) -> None:
    async def hostile(client, body: dict) -> tuple[float, openai.APIStatusError | None]:
        start = time.monotonic()
        try:
            await ask(client, "Hi.", True, extra_body=body)
        except openai.APIStatusError as error:
            return time.monotonic() - start, error
        return time.monotonic() - start, None

    async def main(clients):
        client = clients["1p1d"]
        plain = asyncio.create_task(ask(client, "Say hello.", True))
        refusals = await asyncio.gather(*(hostile(client, b) for b, _ in HOSTILE.values()))
        return refusals, await plain

    refusals, (text, finish_reason) = run(main, clients)
    assert text and finish_reason in ("stop", "length")
    for (name, (_, words)), (elapsed_s, error) in zip(HOSTILE.items(), refusals):
        assert error is not None and error.status_code == 400, name
        assert words in error.message, (name, error.message)
        assert elapsed_s < 30.0, (name, elapsed_s)  # the node's compile limit is 10 s


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.mark.parametrize("mode", MODES)
def test_tool_call_round_trip(clients, mode) -> None:
    """The model calls the named tool, the client sends its result, the model answers."""
    named = {"type": "function", "function": {"name": "get_weather"}}

    async def main(clients):
        client = clients[mode]
        first = await client.chat.completions.create(
            model=MODEL, messages=WEATHER_QUESTION, tools=[WEATHER], tool_choice=named,
            max_tokens=60, temperature=0.0,
        )  # fmt: skip
        message = first.choices[0].message
        followup = [
            *WEATHER_QUESTION,
            message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": message.tool_calls[0].id,
             "content": '{"weather": "sunny", "celsius": 21}'},
        ]  # fmt: skip
        second = await client.chat.completions.create(
            model=MODEL, messages=followup, tools=[WEATHER], max_tokens=30, temperature=0.0
        )
        return first, second

    first, second = run(main, clients)
    assert first.choices[0].finish_reason == "tool_calls"
    (call,) = first.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    answer = second.choices[0]
    assert answer.finish_reason in ("stop", "length")
    assert answer.message.content or answer.message.tool_calls


def test_required_tool_call_streamed_with_continuous_usage(clients) -> None:
    """tool_choice required, streamed with usage on every chunk (the benchmark tools' shape):
    the deltas name the function once, then carry its arguments."""

    async def main(clients):
        stream = await clients["1p1d"].chat.completions.create(
            model=MODEL, messages=WEATHER_QUESTION, tools=[WEATHER], tool_choice="required",
            max_tokens=60, temperature=0.0, stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )  # fmt: skip
        return [chunk async for chunk in stream]

    chunks = run(main, clients)
    assert all(chunk.usage is not None for chunk in chunks)
    calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert calls and calls[0].function.name == "get_weather" and calls[0].id
    arguments = "".join(tc.function.arguments or "" for tc in calls if tc.index == 0)
    jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


@pytest.fixture(scope="module")
def tokenizer():
    from engine.model.sources import resolve_model_source
    from pdserve.tokenizer import Tokenizer

    return Tokenizer.from_dir(resolve_model_source(MODEL).tokenizer_dir)


@pytest.mark.parametrize("mode", MODES)
def test_echo_logprobs_score_the_prompt_as_generation_did(clients, tokenizer, mode) -> None:
    """lm-eval's loglikelihood request (local-completions: token-id prompt, echo, logprobs 1,
    max_tokens 1, temperature 0, seed 1234): the prompt's logprobs equal those its tokens got
    when they were generated (1P1D: computed by the prefill node)."""
    prompt_ids = tokenizer.encode("The capital of France is")

    async def generate(clients):
        return await clients[mode].completions.create(
            model=MODEL, prompt=prompt_ids, max_tokens=8, temperature=0.0, logprobs=1
        )

    generated = run(generate, clients).choices[0]
    output_ids = tokenizer.encode(generated.text, add_special_tokens=False)
    assert [tokenizer.decode([t]) for t in output_ids] == generated.logprobs.tokens

    async def score(clients):
        return await clients[mode].completions.create(
            model=MODEL, prompt=prompt_ids + output_ids, max_tokens=1, temperature=0,
            logprobs=1, seed=1234, echo=True,
        )  # fmt: skip

    scored = run(score, clients).choices[0]
    logprobs = scored.logprobs
    assert scored.text.startswith(tokenizer.decode(prompt_ids) + generated.text)
    assert len(logprobs.tokens) == len(prompt_ids) + len(output_ids) + 1  # + the new token
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    got = logprobs.token_logprobs[len(prompt_ids) : -1]
    assert got == pytest.approx(generated.logprobs.token_logprobs, abs=2e-3)
    for token, lp, top in zip(logprobs.tokens[1:], logprobs.token_logprobs[1:],
                              logprobs.top_logprobs[1:]):  # fmt: skip
        assert len(top) >= 1 and lp <= max(top.values()) + 1e-6, token


def test_langchain_structured_output_and_tools(clients) -> None:
    """LangChain's ChatOpenAI: with_structured_output (a pydantic model, json_schema) and
    bind_tools with a forced tool."""
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(model=MODEL, base_url=clients["1p1d"], api_key="unused", temperature=0,
                      max_tokens=MAX_TOKENS, timeout=TIMEOUT_S, max_retries=0)  # fmt: skip
    city = chat.with_structured_output(City, method="json_schema").invoke("Describe Paris as JSON.")
    assert isinstance(city, City)
    message = chat.bind_tools([WEATHER], tool_choice="get_weather").invoke(
        "What is the weather in Paris?"
    )
    (call,) = message.tool_calls
    assert call["name"] == "get_weather" and call["id"]
    jsonschema.validate(call["args"], WEATHER["function"]["parameters"])
