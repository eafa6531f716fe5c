"""Send one run's requests to a router at their arrival times and record each timeline.

```
task per request: sleep until its arrival -> wait for a --max-concurrency slot -> send_s
  each streamed chunk with tokens -> its arrival time (client clock) and token count
  finish reason -> OK at the stream's end; gRPC error -> its status; no finish -> NO_FINISH
```
Torch-free: `pd-bench serve` is a client like any other.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Any

import grpc

from benchmarks.serve.datasets import SampleRequest
from benchmarks.serve.metrics import NO_FINISH, OK, RequestRecord
from router.client import GenerationClient, build_request


@dataclass(frozen=True)
class SendOptions:
    temperature: float = 0.0
    ignore_eos: bool = False
    timeout_s: float | None = None
    send_text: bool = True  # text prompts as text (the server tokenizes); False: as ids


def to_proto(request: SampleRequest, options: SendOptions, request_id: str) -> Any:
    sampling: dict[str, Any] = {"max_tokens": request.max_tokens, "temperature": options.temperature,
                "ignore_eos": options.ignore_eos or None}  # fmt: skip
    if request.prompt is not None and (options.send_text or request.prompt_token_ids is None):
        if request.chat:  # the router applies the model's chat template
            messages = [{"role": "user", "content": request.prompt}]
            return build_request(messages=messages, request_id=request_id, **sampling)
        return build_request(request.prompt, request_id=request_id, **sampling)
    if request.prompt_token_ids is None:
        raise ValueError(f"request {request_id} has neither a prompt nor its token ids")
    return build_request(
        prompt_token_ids=list(request.prompt_token_ids), request_id=request_id, **sampling
    )


async def send(
    client: GenerationClient, proto: Any, record: RequestRecord, timeout_s: float | None,
    clock_start: float, text: list[str] | None = None,
) -> None:  # fmt: skip
    """Send `proto`, filling `record`'s timeline (and `text` with the streamed text)."""
    record.send_s = time.perf_counter() - clock_start
    try:
        async for chunk in client.stream(proto, timeout_s):
            now = time.perf_counter() - clock_start
            if chunk.token_ids:
                record.chunk_times_s.append(now)
                record.chunk_tokens.append(len(chunk.token_ids))
            if text is not None:
                text.append(chunk.text)
            if chunk.finish_reason:
                record.finish_reason = chunk.finish_reason
        record.status = OK if record.finish_reason else NO_FINISH
    except grpc.aio.AioRpcError as error:
        record.status, record.error = error.code().name, error.details() or ""
    finally:
        record.end_s = time.perf_counter() - clock_start


async def run_requests(
    addr: str,
    requests: list[SampleRequest],
    offsets_s: list[float],
    options: SendOptions,
    max_concurrency: int | None = None,
    progress: Any = None,
    run_name: str = "run",
) -> tuple[list[RequestRecord], float]:
    """Every request's record, and the run's duration (first send to last end, seconds).
    `progress`: anything with update(n) (a tqdm bar), advanced once per finished request."""
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    records = [RequestRecord(i, r.prompt_len, r.max_tokens) for i, r in enumerate(requests)]
    async with GenerationClient(addr) as client:
        clock_start = time.perf_counter()

        async def one(index: int) -> None:
            delay_s = clock_start + offsets_s[index] - time.perf_counter()
            if delay_s > 0:
                await asyncio.sleep(delay_s)
            async with slots:
                proto = to_proto(requests[index], options, f"{run_name}-{index}")
                await send(client, proto, records[index], options.timeout_s, clock_start)
            if progress is not None:
                progress.update(1)

        await asyncio.gather(*(one(i) for i in range(len(requests))))
    first_send = min((r.send_s for r in records), default=0.0)
    last_end = max((r.end_s for r in records), default=0.0)
    return records, max(last_end - first_send, 0.0)
