"""The load side of `pd-bench router`: one request's client, three ways, and two load shapes.

```
GrpcTarget     Generation.Generate through the router (a stream; first and last token timed)
HttpTarget     POST /v1/completions through the router (aiohttp, keep-alive, not streamed)
DirectTarget   the router's own node calls made by the client itself, no router: the nodes'
               own time as a client sees it (Decode + Prefill at once, AttachTicket once the
               ticket is in, P's first token, D's tokens; colocated: Decode(LOCAL_PREFILL))
one_at_a_time(target, n)        idle latency: each request after the previous one ended
open_loop(target, rate, dur_s)  a request every 1/rate s whatever is in flight (at most
                                MAX_IN_FLIGHT): completions/s, latency, errors
```
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Protocol

import aiohttp
import grpc

from pdserve.v1 import generation_pb2, generation_pb2_grpc, node_pb2, node_pb2_grpc

MAX_IN_FLIGHT = (
    8192  # open loop: beyond, arrivals are dropped (counted): the router is past saturation
)
REQUEST_TIMEOUT_S = 30.0
# HTTP keep-alive connections the client pools (more requests wait for one): a pool, as clients
# keep, not a connection per request in flight, whose set-up would be what the open loop
# measures; under the router's --http-max-requests (512), which answers 503 past it.
HTTP_CONNECTIONS = 256


@dataclass
class Sample:
    ttft_s: float
    total_s: float


@dataclass
class LoadResult:
    samples: list[Sample] = field(default_factory=list)
    num_sent: int = 0
    num_errors: int = 0
    num_dropped: int = 0  # open loop: arrivals skipped with MAX_IN_FLIGHT requests in flight
    elapsed_s: float = 0.0  # first send to last completion
    errors: list[str] = field(default_factory=list)  # the first few

    @property
    def rate(self) -> float:
        return len(self.samples) / self.elapsed_s if self.elapsed_s > 0 else 0.0


class Target(Protocol):
    async def request(self, index: int) -> Sample: ...

    async def close(self) -> None: ...


def _prompt(index: int, prompt_tokens: int) -> list[int]:
    return [(index * 31 + i) % 30000 + 10 for i in range(prompt_tokens)]


class GrpcTarget:
    def __init__(self, address: str, prompt_tokens: int, output_tokens: int) -> None:
        self._channel = grpc.aio.insecure_channel(address)
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)
        self._prompt_tokens = prompt_tokens
        self._sampling = generation_pb2.SamplingParams(
            max_tokens=output_tokens, temperature=0.0, ignore_eos=True
        )

    async def request(self, index: int) -> Sample:
        request = generation_pb2.GenerateRequest(request_id=f"b{index}", sampling=self._sampling)
        request.prompt_token_ids.ids.extend(_prompt(index, self._prompt_tokens))
        start_s = time.perf_counter()
        first_s = 0.0
        finish = ""
        async for chunk in self._stub.Generate(request, timeout=REQUEST_TIMEOUT_S):
            if not first_s and chunk.token_ids:
                first_s = time.perf_counter()
            finish = chunk.finish_reason or finish
        end_s = time.perf_counter()
        if not finish:
            raise RuntimeError("the stream ended without a finish_reason")
        return Sample(first_s - start_s, end_s - start_s)

    async def close(self) -> None:
        await self._channel.close()


class HttpTarget:
    def __init__(self, url: str, prompt_tokens: int, output_tokens: int) -> None:
        self._url = f"{url}/v1/completions"
        connector = aiohttp.TCPConnector(limit=HTTP_CONNECTIONS, force_close=False)
        self._session = aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
        )
        self._prompt_tokens = prompt_tokens
        self._output_tokens = output_tokens
        self.model = ""  # set by the caller (the router's /v1/models)

    async def request(self, index: int) -> Sample:
        body = {
            "model": self.model, "prompt": _prompt(index, self._prompt_tokens),
            "max_tokens": self._output_tokens, "temperature": 0.0, "ignore_eos": True,
        }  # fmt: skip
        start_s = time.perf_counter()
        async with self._session.post(self._url, json=body) as response:
            payload = await response.json()
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}: {payload}")
        total_s = time.perf_counter() - start_s
        if payload["choices"][0]["finish_reason"] is None:
            raise RuntimeError("no finish_reason")
        return Sample(total_s, total_s)

    async def close(self) -> None:
        await self._session.close()


class DirectTarget:
    """The router's node calls, made by the client (no router in between)."""

    def __init__(
        self, decode: str, prefill: str | None, prompt_tokens: int, output_tokens: int
    ) -> None:
        self._channels = [grpc.aio.insecure_channel(decode)]
        self._decode = node_pb2_grpc.DecodeNodeStub(self._channels[0])
        self._prefill = None
        if prefill is not None:
            self._channels.append(grpc.aio.insecure_channel(prefill))
            self._prefill = node_pb2_grpc.PrefillNodeStub(self._channels[1])
        self._prompt_tokens = prompt_tokens
        self._sampling = node_pb2.NodeSamplingParams(max_tokens=output_tokens, seed=1)

    async def request(self, index: int) -> Sample:
        request_id = f"b{index}.direct"
        ids = _prompt(index, self._prompt_tokens)
        start_s = time.perf_counter()
        mode = node_pb2.DECODE_MODE_LOCAL_PREFILL
        if self._prefill is not None:
            mode = node_pb2.DECODE_MODE_DISAGGREGATED
        decode = self._decode.Decode(
            node_pb2.DecodeRequest(
                request_id=request_id, prompt_token_ids=ids, sampling=self._sampling, mode=mode
            ),
            timeout=REQUEST_TIMEOUT_S,
        )
        first_s = 0.0
        prefill_task = None
        if self._prefill is not None:
            prefill = self._prefill.Prefill(
                node_pb2.PrefillRequest(
                    request_id=request_id, prompt_token_ids=ids, sampling=self._sampling
                ),
                timeout=REQUEST_TIMEOUT_S,
            )
            message = await decode.read()
            prefill_task = asyncio.create_task(self._prefill_leg(request_id, prefill, message))
        while True:
            message = await decode.read()
            if message is grpc.aio.EOF:
                raise RuntimeError("the decode stream ended without a finish_reason")
            if not first_s and message.tokens.token_ids:
                first_s = time.perf_counter()
            if message.tokens.finish_reason:
                break
        end_s = time.perf_counter()
        if prefill_task is not None:
            first_s = min(first_s, await prefill_task)
        return Sample(first_s - start_s, end_s - start_s)

    async def _prefill_leg(
        self, request_id: str, call: grpc.aio.UnaryStreamCall, decode_first: node_pb2.DecodeResponse
    ) -> float:
        """AttachTicket (D's ticket) and P's first token; when the first token came."""
        assert self._prefill is not None
        attach = self._prefill.AttachTicket(
            node_pb2.AttachTicketRequest(request_id=request_id, ticket=decode_first.ticket),
            timeout=REQUEST_TIMEOUT_S,
        )
        await call.read()  # the first token
        first_s = time.perf_counter()
        await attach
        await call.read()  # the transfer result (P sent the "KV" before it)
        return first_s

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()


async def one_at_a_time(target: Target, num_requests: int, first_index: int = 0) -> LoadResult:
    result = LoadResult()
    start_s = time.perf_counter()
    for i in range(first_index, first_index + num_requests):
        result.num_sent += 1
        try:
            result.samples.append(await target.request(i))
        except Exception as error:  # noqa: BLE001 - counted and shown
            _failed(result, error)
    result.elapsed_s = time.perf_counter() - start_s
    return result


async def open_loop(target: Target, rate: float, duration_s: float, first_index: int) -> LoadResult:
    """A request every 1/rate s for duration_s; waits for the ones in flight (bounded)."""
    result = LoadResult()
    in_flight: set[asyncio.Task[None]] = set()
    last_end_s = 0.0

    async def one(index: int) -> None:
        nonlocal last_end_s
        try:
            result.samples.append(await target.request(index))
        except Exception as error:  # noqa: BLE001 - counted and shown
            _failed(result, error)
        last_end_s = time.perf_counter()

    start_s = time.perf_counter()
    num_arrivals = int(rate * duration_s)
    for n in range(num_arrivals):
        delay_s = start_s + n / rate - time.perf_counter()
        if delay_s > 0:
            await asyncio.sleep(delay_s)
        if len(in_flight) >= MAX_IN_FLIGHT:
            result.num_dropped += 1
            continue
        result.num_sent += 1
        task = asyncio.create_task(one(first_index + n))
        in_flight.add(task)
        task.add_done_callback(in_flight.discard)
    if in_flight:
        await asyncio.wait(in_flight, timeout=REQUEST_TIMEOUT_S + 5)
    result.elapsed_s = max(last_end_s - start_s, 1e-9)
    return result


def _failed(result: LoadResult, error: Exception) -> None:
    result.num_errors += 1
    if len(result.errors) < 3:
        result.errors.append(f"{type(error).__name__}: {str(error)[:200]}")
