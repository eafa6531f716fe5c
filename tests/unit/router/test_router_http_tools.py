"""Tool calls and continuous usage through a real RouterServer over fake nodes (the official
`openai` client): a Hermes-format output comes back as OpenAI tool_calls, whole and streamed;
the tools reach the chat template; continuous_usage_stats puts usage on every chunk."""

from __future__ import annotations

import json

import openai
import pytest
import router_fakes
from router_fakes import run
from router_http_fakes import TEXT, base_url, harness

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def call_ids(tokenizer) -> list[int]:
    return tokenizer.encode("Sure. " + CALL, add_special_tokens=False)


def test_auto_tool_calls_whole_and_streamed(
    tokenizer_files, tokenizer, call_ids, monkeypatch
) -> None:
    monkeypatch.setattr(router_fakes, "MAX_MODEL_LEN", 2048)  # the Hermes prompt is long

    async def body():
        async with harness(tokenizer_files, call_ids) as h:
            client = openai.AsyncOpenAI(base_url=base_url(h), api_key="none", max_retries=0)
            whole = await client.chat.completions.create(
                model="fake-model", messages=MESSAGES, tools=[WEATHER], max_tokens=200
            )
            stream = await client.chat.completions.create(
                model="fake-model", messages=MESSAGES, tools=[WEATHER], max_tokens=200,
                stream=True,
            )  # fmt: skip
            chunks = [c async for c in stream]
            await client.close()
            return whole, chunks, h

    whole, chunks, h = run(body())
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Sure. "
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    # the template got the tools (the fake model's ChatML template: the Hermes system prompt)
    prompt = tokenizer.decode(list(h.decode[0].requests[0].prompt_token_ids))
    assert "<tools>" in prompt and '"get_weather"' in prompt
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == "Sure. "
    streamed = [tc for d in deltas for tc in d.tool_calls or []]
    assert len(streamed) == 1 and streamed[0].index == 0
    assert streamed[0].function.name == "get_weather"
    assert json.loads(streamed[0].function.arguments) == {"city": "Paris"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_continuous_usage_stats_on_every_chunk(tokenizer_files, tokenizer) -> None:
    output_ids = tokenizer.encode(TEXT, add_special_tokens=False)

    async def body():
        async with harness(tokenizer_files, output_ids) as h:
            client = openai.AsyncOpenAI(base_url=base_url(h), api_key="none", max_retries=0)
            stream = await client.completions.create(
                model="fake-model", prompt="hello", max_tokens=5, stream=True,
                stream_options={"include_usage": True, "continuous_usage_stats": True},
            )  # fmt: skip
            chunks = [c async for c in stream]
            await client.close()
            return chunks

    chunks = run(body())
    prompt_tokens = len(tokenizer.encode("hello"))
    assert all(c.usage is not None for c in chunks)
    assert {c.usage.prompt_tokens for c in chunks} == {prompt_tokens}
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 5
    for c in chunks:
        assert c.usage.total_tokens == prompt_tokens + c.usage.completion_tokens
