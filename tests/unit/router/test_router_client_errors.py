"""Issue 39 item 10: what clients learn when a request fails. No internal address (a node's,
a peer's, a KV transport's) reaches them, over gRPC or HTTP, while the router's log keeps it;
an HTTP stream that fails before its first token gets its error status, not a 200 followed by
an error event."""

from __future__ import annotations

import grpc
import httpx
import pytest
from router_fakes import run
from router_http_fakes import TEXT, base_url, harness

from router.errors import ADDRESS, RouterError, redact_addresses


@pytest.fixture(scope="module")
def output_ids(tokenizer) -> list[int]:
    return tokenizer.encode(TEXT, add_special_tokens=False)


@pytest.mark.parametrize(
    "message",
    [
        "decode node 10.0.0.7:50052: UNAVAILABLE: failed to connect",
        "RESOURCE_EXHAUSTED: this caller (ipv4:127.0.0.1:41234) holds 188 KV blocks",
        "transfer to tcp://10.1.2.3:5600 failed; ucx://node-7.cluster.local:13337 too",
        "peer [fd00::17]:50051 refused, [::1] too",
        "prefill node decode-3.pdserve.svc:50051: DEADLINE_EXCEEDED",
        "registry redis://:secret@redis.internal:6379/0 is away",
    ],
)
def test_addresses_are_redacted_for_clients_and_kept_for_the_log(message):
    error = RouterError(grpc.StatusCode.UNAVAILABLE, message)
    assert ADDRESS in error.message and error.detail == message and message in str(error)
    for fragment in ("10.0.0.7", "127.0.0.1", "10.1.2.3", "node-7", "fd00", "::1",
                     "decode-3", "redis.internal", "secret"):  # fmt: skip
        assert fragment not in error.message, error.message


def test_words_and_numbers_that_are_no_address_stay():
    text = "prompt (12 tokens) + max_tokens (4) = 16 exceeds 8.5 of router.http: 3.14 OK"
    assert redact_addresses(text) == text


@pytest.mark.parametrize(("code", "status"), [(grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
                                              (grpc.StatusCode.UNAVAILABLE, 503)])  # fmt: skip
def test_a_stream_that_cannot_be_served_gets_its_status_first(
    tokenizer_files, output_ids, code, status
):
    async def body():
        async with harness(tokenizer_files, output_ids, num_prefill=0) as h:
            h.decode[0].fail_code = code
            async with httpx.AsyncClient(base_url=base_url(h), timeout=30) as http:
                request = {"model": "fake-model", "prompt": "x", "max_tokens": 4, "stream": True}
                async with http.stream("POST", "/completions", json=request) as response:
                    content = (await response.aread()).decode()
                chat = await http.post("/chat/completions", json={
                    "model": "fake-model", "stream": True, "max_tokens": 4,
                    "messages": [{"role": "user", "content": "x"}]})  # fmt: skip
            return response, content, chat, h.decode[0].address

    response, content, chat, address = run(body())
    assert response.status_code == status and chat.status_code == status
    assert "data:" not in content and address not in content
    assert code.name in content or "scripted decode failure" in content


def test_a_stream_that_starts_is_served_as_before(tokenizer_files, output_ids):
    async def body():
        async with harness(tokenizer_files, output_ids) as h:
            async with httpx.AsyncClient(base_url=base_url(h), timeout=30) as http:
                response = await http.post("/completions", json={
                    "model": "fake-model", "prompt": "x", "max_tokens": 4, "stream": True,
                    "stream_options": {"include_usage": True}})  # fmt: skip
            return response

    response = run(body())
    events = [line for line in response.text.splitlines() if line.startswith("data: ")]
    assert response.status_code == 200 and events[-1] == "data: [DONE]"
    assert '"usage"' in events[-2] and len(events) >= 4
