"""GenerationClient: a small async client of the router, for pd-client, tests and benchmarks.

```python
async with GenerationClient("127.0.0.1:50051") as client:
    async for chunk in client.generate("Hello", max_tokens=32, temperature=0.0):
        print(chunk.text, end="")
    result = await client.generate_all(messages=[{"role": "user", "content": "Hi"}])
```
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from pdserve.config import DEFAULT_HOST, DEFAULT_ROUTER_PORT
from pdserve.tokenizer import Tokenizer
from pdserve.v1 import generation_pb2, generation_pb2_grpc
from router.node_client import MAX_RECEIVE_MESSAGE_BYTES, tokenizer_from_files
from router.request_record import TRACE_METADATA


@dataclass
class GenerationResult:
    """A whole completion, assembled from its chunks."""

    request_id: str = ""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    usage: generation_pb2.Usage = field(default_factory=generation_pb2.Usage)
    logprobs: list[generation_pb2.TokenLogprob] = field(default_factory=list)

    def add(self, chunk: generation_pb2.GenerateResponse) -> None:
        self.request_id = chunk.request_id
        self.token_ids.extend(chunk.token_ids)
        self.text += chunk.text
        self.logprobs.extend(chunk.logprobs)
        if chunk.finish_reason:
            self.finish_reason = chunk.finish_reason
            self.usage.CopyFrom(chunk.usage)

    def to_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "token_ids": self.token_ids,
            "text": self.text,
            "finish_reason": self.finish_reason,
            "usage": {
                "prompt_tokens": self.usage.prompt_tokens,
                "completion_tokens": self.usage.completion_tokens,
                "cached_tokens": self.usage.cached_tokens,
            },
        }


def build_request(
    prompt: str | None = None,
    *,
    prompt_token_ids: Sequence[int] | None = None,
    messages: Sequence[Mapping[str, str]] | None = None,
    request_id: str = "",
    cache_salt: str = "",
    **sampling: Any,
) -> generation_pb2.GenerateRequest:
    """A GenerateRequest from exactly one input; `sampling` holds SamplingParams fields by name
    (None: unset, the engine's default); `cache_salt`: its prefix-cache namespace (vLLM's)."""
    inputs = [x for x in (prompt, prompt_token_ids, messages) if x is not None]
    if len(inputs) != 1:
        raise ValueError("give exactly one of prompt, prompt_token_ids or messages")
    request = generation_pb2.GenerateRequest(
        request_id=request_id,
        cache_salt=cache_salt,
        sampling=generation_pb2.SamplingParams(
            **{name: value for name, value in sampling.items() if value is not None}
        ),
    )
    if prompt is not None:
        request.prompt = prompt
    elif prompt_token_ids is not None:
        request.prompt_token_ids.SetInParent()  # selects the input even when empty
        request.prompt_token_ids.ids.extend(prompt_token_ids)
    elif messages is not None:
        request.messages.SetInParent()
        for message in messages:
            request.messages.messages.add(role=message["role"], content=message["content"])
    return request


_CHANNEL_OPTIONS = (("grpc.max_receive_message_length", MAX_RECEIVE_MESSAGE_BYTES),)


class GenerationClient:
    """Async client of one router. Construct it inside the event loop that uses it."""

    def __init__(
        self, addr: str = f"{DEFAULT_HOST}:{DEFAULT_ROUTER_PORT}", api_key: str | None = None
    ) -> None:
        """`api_key`: sent as `authorization: Bearer KEY` on every call (routers started with
        --api-key-file need one)."""
        self.addr = addr
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
        self._channel = grpc.aio.insecure_channel(addr, options=_CHANNEL_OPTIONS)
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)

    async def __aenter__(self) -> GenerationClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def stream(
        self,
        request: generation_pb2.GenerateRequest,
        timeout_s: float | None = None,
        trace: dict[str, float] | None = None,
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        """The response chunks of `request`; leaving the loop early cancels the call. With a
        `trace` dict, the router records the request's milestones and they are put there once
        the stream ends (name -> time.monotonic() of the router's host: router/request_record.py)."""
        metadata = self._metadata
        if trace is not None:
            metadata = (*(metadata or ()), (TRACE_METADATA, "1"))
        call = self._stub.Generate(request, timeout=timeout_s, metadata=metadata)
        try:
            async for chunk in call:
                yield chunk
            if trace is not None:
                for key, value in await call.trailing_metadata() or ():
                    if key == TRACE_METADATA and isinstance(value, str):
                        trace.update(json.loads(value))
        finally:
            call.cancel()

    def generate(
        self, prompt: str | None = None, *, timeout_s: float | None = None, **kwargs: Any
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        """Streams a completion; `kwargs` as `build_request`'s."""
        return self.stream(build_request(prompt, **kwargs), timeout_s)

    async def generate_all(
        self, prompt: str | None = None, *, timeout_s: float | None = None, **kwargs: Any
    ) -> GenerationResult:
        """The whole completion at once."""
        result = GenerationResult()
        async for chunk in self.generate(prompt, timeout_s=timeout_s, **kwargs):
            result.add(chunk)
        return result

    async def model_info(self, timeout_s: float | None = None) -> generation_pb2.ModelInfo:
        info: generation_pb2.ModelInfo = await self._stub.GetModelInfo(
            generation_pb2.GetModelInfoRequest(), timeout=timeout_s, metadata=self._metadata
        )
        return info

    async def tokenizer(self, timeout_s: float | None = None) -> Tokenizer | None:
        """The served model's tokenizer (None: the model has none and takes token ids)."""
        files = await self._stub.GetTokenizer(
            generation_pb2.GetModelTokenizerRequest(), timeout=timeout_s, metadata=self._metadata
        )
        if not files.tokenizer_json:
            return None
        info = await self.model_info(timeout_s)
        return tokenizer_from_files(files, info.model_name)
