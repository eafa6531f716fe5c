"""The OpenAI-compatible HTTP API of a real RouterServer over fake nodes (fast, in one loop):
response shapes, streaming, /health and /metrics, cancellation, batches (errors and limits:
test_router_http_errors.py)."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from router_fakes import TEST_TIMEOUT_S, RouterHarness, run
from router_http_fakes import TEXT, base_url, harness


@pytest.fixture(scope="module")
def output_ids(tokenizer) -> list[int]:
    return tokenizer.encode(TEXT, add_special_tokens=False)


def test_completions_and_chat_match_grpc(tokenizer_files, tokenizer, output_ids) -> None:
    async def body():
        async with harness(tokenizer_files, output_ids) as h:
            client = openai.AsyncOpenAI(base_url=base_url(h), api_key="none", max_retries=0)
            grpc_result = await h.client.generate_all("hello world", max_tokens=5, temperature=0)
            completion = await client.completions.create(
                model="fake-model", prompt="hello world", max_tokens=5, temperature=0
            )
            chat = await client.chat.completions.create(
                model="fake-model", messages=[{"role": "user", "content": "hi"}], max_tokens=3
            )
            models = await client.models.list()
            await client.close()
            return grpc_result, completion, chat, models, h

    grpc_result, completion, chat, models, h = run(body())
    assert completion.choices[0].text == grpc_result.text == tokenizer.decode(output_ids[:5])
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage.prompt_tokens == len(tokenizer.encode("hello world"))
    assert completion.usage.completion_tokens == 5
    assert completion.id.startswith("cmpl-") and completion.object == "text_completion"
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == tokenizer.decode(output_ids[:3])
    assert chat.usage.completion_tokens == 3
    assert [m.id for m in models.data] == ["fake-model"]
    decode_requests = h.decode[0].requests
    assert decode_requests[1].request_id.startswith(completion.id + "-0.")
    assert list(decode_requests[1].prompt_token_ids) == list(decode_requests[0].prompt_token_ids)


def test_streaming_n2_logprobs_stop_and_usage(tokenizer_files, tokenizer, output_ids) -> None:
    stop_word = tokenizer.decode(output_ids[:4]).split()[-1]

    async def body():
        async with harness(tokenizer_files, output_ids) as h:
            client = openai.AsyncOpenAI(base_url=base_url(h), api_key="none", max_retries=0)
            stream = await client.completions.create(
                model="fake-model", prompt=["a", "b"], max_tokens=4, n=2, logprobs=1, stream=True,
                stream_options={"include_usage": True},
            )  # fmt: skip
            chunks = [c async for c in stream]
            chat_stream = await client.chat.completions.create(
                model="fake-model", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                stop=[stop_word], stream=True, logprobs=True, top_logprobs=1,
            )  # fmt: skip
            chat_chunks = [c async for c in chat_stream]
            await client.close()
            return chunks, chat_chunks

    chunks, chat_chunks = run(body())
    texts = {i: "" for i in range(4)}
    for chunk in chunks[:-1]:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            assert choice.logprobs.tokens and len(choice.logprobs.top_logprobs[0]) == 1
    assert set(texts.values()) == {tokenizer.decode(output_ids[:4])}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert chunks[-1].usage.prompt_tokens == 2 * len(tokenizer.encode("a"))
    content = "".join(c.choices[0].delta.content or "" for c in chat_chunks if c.choices)
    assert (
        stop_word not in content and content == tokenizer.decode(output_ids[:4]).split(stop_word)[0]
    )
    assert chat_chunks[0].choices[0].delta.role == "assistant"
    finals = [c.choices[0].finish_reason for c in chat_chunks if c.choices[0].finish_reason]
    assert finals == ["stop"]
    entries = [
        e for c in chat_chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content
    ]
    assert entries and all(e.token and len(e.top_logprobs) == 1 for e in entries)


def test_health_metrics_and_chat_without_max_tokens(tokenizer_files, output_ids) -> None:
    async def body():
        async with harness(tokenizer_files, output_ids) as h:
            async with httpx.AsyncClient(base_url=h.router.http.url) as http:
                health = await http.get("/health")
                chat = await http.post("/v1/chat/completions", json={
                    "model": "fake-model", "messages": [{"role": "user", "content": "hi"}],
                    "min_tokens": 2})  # fmt: skip
                await h.client.generate_all("hello", max_tokens=3)
                metrics = (await http.get("/metrics")).text
            return health, chat, metrics, h

    health, chat, metrics, h = run(body())
    assert health.status_code == 200
    # No max_tokens: the rest of the context, so the fake model's whole output, "stop"
    # (min_tokens above 1 is no conflict: max_tokens is not 1).
    assert chat.json()["choices"][0]["finish_reason"] == "stop"
    assert h.decode[0].requests[0].sampling.max_tokens > len(output_ids)
    assert h.decode[0].requests[0].sampling.min_tokens == 2
    assert 'pdserve_requests_total{api="http",finish_reason="stop",status="OK"} 1.0' in metrics
    assert 'pdserve_requests_total{api="grpc",finish_reason="length",status="OK"} 1.0' in metrics
    assert "pdserve_time_to_first_token_seconds_count 2.0" in metrics
    assert "pdserve_e2e_request_latency_seconds_count 2.0" in metrics
    assert f"pdserve_generation_tokens_total {len(output_ids) + 3}.0" in metrics
    assert "pdserve_requests_running 0.0" in metrics
    assert 'pdserve_routes_total{kind="disaggregated",reason=""} 2.0' in metrics


def test_a_client_leaving_a_whole_body_request_cancels_it(tokenizer_files, output_ids) -> None:
    async def body():
        async with harness(tokenizer_files, output_ids) as h:
            h.decode[0].gate.clear()  # D holds its chunks: the request cannot end by itself
            async with httpx.AsyncClient(base_url=h.router.http.url) as http:
                post = asyncio.create_task(http.post("/v1/completions", json={
                    "model": "fake-model", "prompt": "hi", "max_tokens": 6}))  # fmt: skip
                async with asyncio.timeout(TEST_TIMEOUT_S):
                    while not h.decode[0].requests:
                        await asyncio.sleep(0.01)
                post.cancel()  # the client closes its connection
                await asyncio.gather(post, return_exceptions=True)
            async with asyncio.timeout(TEST_TIMEOUT_S):  # D told, and the router's count
                while not (h.decode[0].aborted and h.router.stats.num_cancelled):
                    await asyncio.sleep(0.01)
            return h

    h = run(body())
    request_id = h.decode[0].requests[0].request_id
    # The node call is cancelled and D is sent an Abort: grpc can lose a cancellation that
    # reaches D just after the call started (D's handler then ran on, for nobody)
    assert h.decode[0].aborted == [request_id]
    assert h.decode[0].cancelled in ([], [request_id])
    assert h.router.stats.num_cancelled == 1


def test_no_http_server_when_the_port_is_0(tokenizer_files, output_ids) -> None:
    async def body():
        async with RouterHarness(tokenizer_files, output_ids) as h:
            return h.router.http

    assert run(body()) is None


def test_a_large_batch_runs_its_choices_a_few_at_a_time(
    tokenizer_files, output_ids, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch of more prompts than MAX_CHOICES_IN_FLIGHT completes, never running more than
    that many choices at once (hundreds at once met the decode node's cap on awaited
    hand-offs: a 429 on every retry)."""
    from router.http import openai_serving
    from router.request_handler import RequestHandler

    monkeypatch.setattr(openai_serving, "MAX_CHOICES_IN_FLIGHT", 3)
    active, peak = 0, 0
    real = RequestHandler.stream

    async def counting(self, *args, **kwargs):
        nonlocal active, peak
        active += 1
        peak = max(peak, active)
        try:
            async for response in real(self, *args, **kwargs):
                yield response
        finally:
            active -= 1

    monkeypatch.setattr(RequestHandler, "stream", counting)
    prompts = [f"prompt {i}" for i in range(10)]

    async def body():
        payload = {"model": "fake-model", "prompt": prompts, "max_tokens": 3}
        async with (
            harness(tokenizer_files, output_ids) as h,
            httpx.AsyncClient(base_url=base_url(h), timeout=TEST_TIMEOUT_S) as http,
        ):
            return await http.post("/completions", json=payload)

    response = run(body())
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert sorted(c["index"] for c in choices) == list(range(10))
    assert all(c["text"] and c["finish_reason"] == "length" for c in choices)
    assert 1 <= peak <= 3, peak
