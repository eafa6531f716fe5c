"""The OpenAI-compatible HTTP API end to end: the official `openai` client (sync and async)
against a real CPU pd-serve (1P1D), checked against the tokenizer and the gRPC API."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from router.client import GenerationClient
from tests.e2e.conftest import MODEL, REAL_MODEL_CLUSTERS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300), REAL_MODEL_CLUSTERS]

PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 12
TIMEOUT_S = 120.0


def grpc_call(cluster, method: str, *args, **kwargs):
    async def main():
        async with GenerationClient(cluster.router) as client:
            return await getattr(client, method)(*args, **kwargs)

    return asyncio.run(asyncio.wait_for(main(), TIMEOUT_S))


def assert_tokens_spell(tokens: list[str], text: str, finish_reason: str, tokenizer) -> None:
    """The logprobs' token texts, in order, spell the text; a request that ended on the end of
    sequence token has that (special, not in the text) token last."""
    if finish_reason == "stop" and tokens and tokens[-1] == tokenizer.eos_token:
        tokens = tokens[:-1]
    assert "".join(tokens) == text


@pytest.fixture(scope="module")
def client(cluster_http):
    with openai.OpenAI(
        base_url=f"{cluster_http.http_url}/v1", api_key="unused", timeout=TIMEOUT_S, max_retries=0
    ) as client:
        yield client


@pytest.fixture(scope="module")
def tokenizer(cluster_http):
    return grpc_call(cluster_http, "tokenizer", timeout_s=30)


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_completion_n2_logprobs_usage(client, tokenizer):
    response = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, n=2, logprobs=2
    )
    assert [c.index for c in response.choices] == [0, 1]
    assert response.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    for choice in response.choices:
        logprobs = choice.logprobs
        assert choice.finish_reason in ("stop", "length")
        assert_tokens_spell(logprobs.tokens, choice.text, choice.finish_reason, tokenizer)
        assert len(logprobs.token_logprobs) == len(logprobs.tokens)
        for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs,
                                       logprobs.top_logprobs, strict=True):  # fmt: skip
            assert logprob <= 0 and len(top) == 2
            assert top[token] == pytest.approx(logprob)  # greedy: the sampled token is the top
            assert max(top.values()) == pytest.approx(logprob)
        assert logprobs.text_offset[0] == 0
    # greedy: both choices are the same text; usage counts every returned token
    assert response.choices[0].text == response.choices[1].text
    num_tokens = sum(len(c.logprobs.tokens) for c in response.choices)
    assert response.usage.completion_tokens == num_tokens
    assert response.usage.total_tokens == response.usage.prompt_tokens + num_tokens


def test_chat_logprobs_with_token_text(client, tokenizer):
    response = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
        logprobs=True, top_logprobs=3,
    )  # fmt: skip
    choice = response.choices[0]
    assert choice.message.role == "assistant"
    content = choice.logprobs.content
    assert_tokens_spell(
        [entry.token for entry in content], choice.message.content, choice.finish_reason, tokenizer
    )
    for entry in content:
        assert [t.token for t in entry.top_logprobs][0] == entry.token
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
    # each token's own bytes, together, are the content's (a multi-byte character may span tokens)
    spelled = b"".join(bytes(entry.bytes) for entry in content).decode()
    assert spelled.removesuffix(tokenizer.eos_token) == choice.message.content
    prompt = tokenizer.apply_chat_template(MESSAGES)
    assert response.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))
    assert response.usage.completion_tokens == len(content)


def test_greedy_http_text_equals_grpc_text(client, cluster_http):
    http = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                     temperature=0)  # fmt: skip
    grpc = grpc_call(cluster_http, "generate_all", PROMPT, timeout_s=TIMEOUT_S, temperature=0.0,
                     max_tokens=MAX_TOKENS)  # fmt: skip
    assert http.choices[0].text == grpc.text and grpc.text
    assert http.choices[0].finish_reason == grpc.finish_reason
    assert http.usage.completion_tokens == len(grpc.token_ids)
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES,
                                          max_tokens=MAX_TOKENS, temperature=0)  # fmt: skip
    grpc_chat = grpc_call(cluster_http, "generate_all", messages=MESSAGES, timeout_s=TIMEOUT_S,
                          temperature=0.0, max_tokens=MAX_TOKENS)  # fmt: skip
    assert chat.choices[0].message.content == grpc_chat.text and grpc_chat.text


def test_streaming_equals_non_streaming_and_ends_with_usage(client):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                     temperature=0)  # fmt: skip
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip  (the iteration ends: the stream closed with [DONE])
    *token_chunks, usage_chunk = chunks
    assert "".join(c.choices[0].text for c in token_chunks) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in token_chunks][-1] == full.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in token_chunks[:-1])
    assert usage_chunk.choices == [] and usage_chunk.usage == full.usage
    assert all(c.usage is None for c in token_chunks)

    chat_chunks = list(client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ))  # fmt: skip
    chat_full = client.chat.completions.create(model=MODEL, messages=MESSAGES,
                                               max_tokens=MAX_TOKENS, temperature=0)  # fmt: skip
    *token_chunks, usage_chunk = chat_chunks
    assert token_chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in token_chunks)
    assert text == chat_full.choices[0].message.content
    assert token_chunks[-1].choices[0].finish_reason == chat_full.choices[0].finish_reason
    # the same counts (cached_tokens aside: the later request may find the earlier's prefix)
    for field in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert getattr(usage_chunk.usage, field) == getattr(chat_full.usage, field), field


def test_stop_string_cuts_the_text_before_it(client):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                     temperature=0).choices[0].text  # fmt: skip
    # a stop string whose first occurrence is past the start of the greedy text
    cut = next(k for k in range(2, len(full) - 2)
               if full[k:k + 2].strip() and full.find(full[k:k + 2]) == k)  # fmt: skip
    stopped = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                        temperature=0, stop=[full[cut:cut + 2]])  # fmt: skip
    assert stopped.choices[0].text == full[:cut]
    assert stopped.choices[0].finish_reason == "stop"
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                          temperature=0).choices[0].message.content  # fmt: skip
    cut = next(k for k in range(2, len(chat) - 2)
               if chat[k:k + 2].strip() and chat.find(chat[k:k + 2]) == k)  # fmt: skip
    stopped = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0,
                                             max_tokens=MAX_TOKENS, stop=chat[cut:cut + 2])  # fmt: skip
    assert stopped.choices[0].message.content == chat[:cut]
    assert stopped.choices[0].finish_reason == "stop"


def test_async_client_streams_and_completes_concurrently(cluster_http):
    async def main():
        async with openai.AsyncOpenAI(base_url=f"{cluster_http.http_url}/v1", api_key="unused",
                                      timeout=TIMEOUT_S, max_retries=0) as client:  # fmt: skip

            async def streamed_chat() -> tuple[dict[int, str], object]:
                texts: dict[int, str] = {0: "", 1: ""}
                usage = None
                stream = await client.chat.completions.create(
                    model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, n=2,
                    stream=True, stream_options={"include_usage": True},
                )  # fmt: skip
                async for chunk in stream:
                    for choice in chunk.choices:
                        texts[choice.index] += choice.delta.content or ""
                    usage = chunk.usage or usage
                return texts, usage

            return await asyncio.gather(
                streamed_chat(),
                client.chat.completions.create(model=MODEL, messages=MESSAGES,
                                               max_tokens=MAX_TOKENS, temperature=0),
                client.completions.create(model=MODEL, prompt=[PROMPT, "Hello"],
                                          max_tokens=MAX_TOKENS, temperature=0),
            )  # fmt: skip

    (texts, usage), chat, completion = asyncio.run(asyncio.wait_for(main(), TIMEOUT_S))
    assert texts[0] == texts[1] == chat.choices[0].message.content
    assert usage.completion_tokens == 2 * chat.usage.completion_tokens
    assert usage.prompt_tokens == chat.usage.prompt_tokens
    assert sorted(c.index for c in completion.choices) == [0, 1]  # one per prompt


BAD_REQUESTS = [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 10**7}, "max_tokens"),  # over the context length
    ({"n": 0}, "n"),
    ({"extra_body": {"tools": [{"type": "function", "function": {"name": "a b"}}]}}, "tools"),
    ({"extra_body": {"response_format": {"type": "json_schema"}}}, "response_format"),
]


@pytest.mark.parametrize(("kwargs", "param"), BAD_REQUESTS, ids=[p for _, p in BAD_REQUESTS])
def test_bad_input_is_a_400_in_openai_error_shape(client, kwargs, param):
    kwargs = {"max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, **kwargs)
    error = caught.value
    assert error.status_code == 400
    assert set(error.body) == {"message", "type", "param", "code"}  # the "error" object
    assert error.body["type"] == "invalid_request_error"
    assert error.body["param"] == param and param in error.body["message"]


def test_unknown_model_and_raw_error_json(client, cluster_http):
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=4)
    assert caught.value.body["code"] == "model_not_found"
    raw = httpx.post(f"{cluster_http.http_url}/v1/completions", timeout=TIMEOUT_S,
                     json={"model": MODEL, "prompt": PROMPT, "temperature": -1})  # fmt: skip
    assert raw.status_code == 400
    assert list(raw.json()) == ["error"]
    assert set(raw.json()["error"]) == {"message", "type", "param", "code"}
