"""The OpenAI-compatible HTTP API's refusals, over fake nodes: bad requests get OpenAI's error
shape naming the parameter, API keys guard the /v1 routes, oversized bodies are refused before
they are read."""

from __future__ import annotations

import httpx
import openai
import pytest
from router_fakes import run
from router_http_fakes import TEXT, base_url, harness


@pytest.fixture(scope="module")
def output_ids(tokenizer) -> list[int]:
    return tokenizer.encode(TEXT, add_special_tokens=False)


@pytest.mark.parametrize(
    ("payload", "status", "param"),
    [
        ({"prompt": "x", "tools": [{"type": "function"}]}, 400, "tools"),
        ({"prompt": "x", "response_format": {"type": "xml"}}, 400, "response_format"),
        (
            {"prompt": "x", "guided_regex": "a", "guided_choice": ["a"]},
            400,
            "guided_regex, guided_choice",
        ),
        ({"prompt": "x", "guided_json": {"enum": list(range(5000))}}, 400, "guided_json"),
        ({"prompt": "x", "n": 0}, 400, "n"),
        ({"prompt": "x", "temperature": "hot"}, 400, "temperature"),
        ({"prompt": []}, 400, "prompt"),
        ({"prompt": "x", "echo": "yes"}, 400, "echo"),
        ({"prompt": "x", "logit_bias": {"x": 1}}, 400, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"5": 500}}, 400, "logit_bias"),
        ({"prompt": "x", "prompt_logprobs": 21}, 400, "prompt_logprobs"),
        ({"prompt": "x", "top_p": 7.0}, 400, "top_p"),  # the shared validation (as gRPC's)
        ({"prompt": [999999]}, 400, "prompt"),
        ({"prompt": "x", "max_tokens": 10**9}, 400, "max_tokens"),  # over the context
        ({"prompt": "x", "model": "other"}, 404, "model"),
        # beyond what the protobuf fields hold: a 400 naming them, not a 500
        ({"prompt": "x", "max_tokens": 2**32}, 400, "max_tokens"),
        ({"prompt": "x", "seed": 10**23}, 400, "seed"),
        ({"prompt": "x", "top_k": 2**31}, 400, "top_k"),
        ({"prompt": "x", "min_tokens": 2**32}, 400, "min_tokens"),
        ({"prompt": "x", "stop_token_ids": [2**32]}, 400, "stop_token_ids"),
    ],
)
def test_bad_requests_get_openai_errors(tokenizer_files, output_ids, payload, status, param):
    async def body():
        async with harness(tokenizer_files, output_ids) as h:
            async with httpx.AsyncClient(base_url=base_url(h)) as http:
                response = await http.post("/completions", json={"model": "fake-model", **payload})
                metrics = (await http.get(h.router.http.url + "/metrics")).text
            return response, metrics, h

    response, metrics, h = run(body())
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    if param is not None and status == 400:
        assert param in error["message"]
    assert not h.decode[0].requests  # nothing reached a node
    label = "INVALID_ARGUMENT" if status == 400 else "NOT_FOUND"
    assert f'pdserve_requests_total{{api="http",finish_reason="",status="{label}"}} 1.0' in metrics


def test_a_lone_surrogate_is_a_400_naming_the_field(tokenizer_files, output_ids) -> None:
    """JSON's \\u escapes can spell half a UTF-16 pair, which is no text: refused by name
    (it once reached the protobuf and came back as a 500); a chat role is named too."""
    bodies = [
        ("/completions", rb'{"model": "fake-model", "prompt": "\ud800"}'),
        ("/completions", rb'{"model": "fake-model", "prompt": "x", "stop": ["ok", "\udfff"]}'),
        ("/chat/completions",
         rb'{"model": "fake-model", "messages": [{"role": "user", "content": "a\ud800b"}]}'),
        ("/chat/completions",
         rb'{"model": "fake-model", "messages": [{"role": "wizard", "content": "hi"}]}'),
    ]  # fmt: skip

    async def body():
        headers = {"content-type": "application/json"}
        async with (
            harness(tokenizer_files, output_ids) as h,
            httpx.AsyncClient(base_url=base_url(h)) as http,
        ):
            return [await http.post(path, content=raw, headers=headers) for path, raw in bodies], h

    responses, h = run(body())
    assert [r.status_code for r in responses] == [400] * 4
    errors = [r.json()["error"] for r in responses]
    assert [e["param"] for e in errors] == ["prompt", "stop", "messages", "messages"]
    assert all("surrogate" in e["message"] for e in errors[:3]), errors
    assert "wizard" in errors[3]["message"]
    assert not h.decode[0].requests


def test_a_chat_error_names_the_parameter_the_body_used(tokenizer_files, output_ids) -> None:
    messages = [{"role": "user", "content": "hi"}]

    async def body():
        async with harness(tokenizer_files, output_ids) as h:
            http = httpx.AsyncClient(base_url=base_url(h))
            errors = [
                (await http.post("/chat/completions", json={
                    "model": "fake-model", "messages": messages, name: 10**9})).json()
                for name in ("max_completion_tokens", "max_tokens")
            ]  # fmt: skip
            await http.aclose()
            return errors

    errors = [response["error"] for response in run(body())]
    assert [e["param"] for e in errors] == ["max_completion_tokens", "max_tokens"]


def test_a_prompt_longer_than_the_context_blames_the_prompt(tokenizer_files, output_ids) -> None:
    """Issue 34: param "messages" / "prompt" (the client set no max_tokens to lower)."""
    long_text = " ".join(["word"] * 400)

    async def body():
        async with harness(tokenizer_files, output_ids) as h:
            http = httpx.AsyncClient(base_url=base_url(h))
            chat = await http.post(
                "/chat/completions",
                json={"model": "fake-model", "messages": [{"role": "user", "content": long_text}]},
            )
            completion = await http.post("/completions", json={
                "model": "fake-model", "prompt": long_text})  # fmt: skip
            await http.aclose()
            return chat, completion

    chat, completion = run(body())
    assert chat.status_code == completion.status_code == 400
    assert chat.json()["error"]["param"] == "messages"
    assert completion.json()["error"]["param"] == "prompt"
    assert "max_tokens" not in completion.json()["error"]["message"]


def test_api_keys_guard_the_v1_routes(tokenizer_files, output_ids, tmp_path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# clients\nsecret-1\n")

    async def body():
        async with harness(tokenizer_files, output_ids, api_key_file=str(keys)) as h:
            url = base_url(h)
            anonymous = openai.AsyncOpenAI(base_url=url, api_key="wrong", max_retries=0)
            with pytest.raises(openai.AuthenticationError) as refused:
                await anonymous.completions.create(model="fake-model", prompt="hi", max_tokens=2)
            with pytest.raises(openai.AuthenticationError):
                await anonymous.models.list()
            client = openai.AsyncOpenAI(base_url=url, api_key="secret-1", max_retries=0)
            completion = await client.completions.create(
                model="fake-model", prompt="hi", max_tokens=2
            )
            async with httpx.AsyncClient(base_url=h.router.http.url) as http:
                open_routes = [(await http.get(p)).status_code for p in ("/health", "/metrics")]
            await anonymous.close()
            await client.close()
            return refused.value, completion, open_routes, h

    refused, completion, open_routes, h = run(body())
    assert refused.status_code == 401 and refused.body["code"] == "invalid_api_key"
    assert completion.usage.completion_tokens == 2
    assert open_routes == [200, 200]  # probes and Prometheus need no key
    assert len(h.decode[0].requests) == 1  # only the authorized request reached a node


def test_a_body_over_the_limit_is_refused_before_it_is_read(tokenizer_files, output_ids):
    limit = 4096

    async def oversized():  # no Content-Length: the limit holds while reading
        yield b'{"model": "fake-model", "prompt": "'
        for _ in range(64):
            yield b"x" * 1024
        yield b'"}'

    async def body():
        async with harness(tokenizer_files, output_ids, max_request_bytes=limit) as h:
            async with httpx.AsyncClient(base_url=base_url(h)) as http:
                declared = await http.post("/completions", content=b"{" + b" " * limit + b"}",
                                           headers={"content-type": "application/json"})  # fmt: skip
                streamed = await http.post("/completions", content=oversized())
                small = await http.post("/completions", json={"model": "fake-model",
                                                              "prompt": "hi", "max_tokens": 2})  # fmt: skip
                metrics = (await http.get(h.router.http.url + "/metrics")).text
            return declared, streamed, small, metrics, h

    declared, streamed, small, metrics, h = run(body())
    refused = 'pdserve_requests_total{api="http",finish_reason="",status="RESOURCE_EXHAUSTED"} 2.0'
    assert refused in metrics
    for response in (declared, streamed):
        assert response.status_code == 413
        assert "--max-request-bytes" in response.json()["error"]["message"]
    assert small.status_code == 200
    assert len(h.decode[0].requests) == 1
