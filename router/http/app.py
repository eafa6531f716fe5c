"""The router's HTTP app (FastAPI): the OpenAI-compatible API, health and Prometheus metrics.

```
GET  /v1/models              the served model
POST /v1/completions         prompt(s) -> text; "stream": true for server-sent events
POST /v1/chat/completions    messages (the model's chat template) -> assistant message
GET  /health                 200 while a decode node is ready and reachable, else 503
GET  /metrics                Prometheus text format (RouterMetrics)
errors                       {"error": {"message", "type", "param", "code"}} (OpenAI's shape)
```

With `--api-key-file`, every /v1/ route needs `Authorization: Bearer KEY` (401 otherwise), as
the gRPC API does; /health and /metrics stay open (probes, Prometheus). A body larger than
`--max-request-bytes` is refused (413) before it is read whole. A client that disconnects
before its response cancels the request (its node calls end), streamed or not.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from router.auth import ApiKeys
from router.http.json_body import INLINE_BYTES, parse_json
from router.http.openai_errors import OpenAIError
from router.http.openai_protocol import (
    DEFAULT_MAX_CHOICES,
    OpenAIRequest,
    parse_chat,
    parse_completion,
)
from router.http.openai_serving import OpenAIServing
from router.metrics import RouterMetrics

T = TypeVar("T")
_CLIENT_CLOSED = 499  # the status nginx logs for a client that closed its connection first
# Bodies larger than INLINE_BYTES parse here, one at a time (json_body: in bounded steps, so the
# event loop gets the GIL back every switch interval; big bodies queue, the loop never waits).
_BODY_THREAD = ThreadPoolExecutor(1, thread_name_prefix="http-body")


def build_app(
    serving: OpenAIServing,
    metrics: RouterMetrics,
    is_ready: Callable[[], bool],
    max_body_bytes: int,
    api_keys: ApiKeys | None = None,
    max_choices: int = DEFAULT_MAX_CHOICES,
) -> FastAPI:
    app = FastAPI(title="pdserve router", docs_url=None, redoc_url=None, openapi_url=None)
    _add_error_handlers(app)
    _add_open_routes(app, metrics, is_ready)
    limits = _BodyLimits(max_body_bytes, max_choices)
    _add_api_routes(app, serving, limits, api_keys)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every error in OpenAI's shape: ours (OpenAIError) and FastAPI's (404, 405, ...)."""

    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, error: OpenAIError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        body = OpenAIError(str(error.detail), status=error.status_code, error_type="not_found_error"
                           if error.status_code == 404 else "invalid_request_error").body()  # fmt: skip
        return JSONResponse(body, status_code=error.status_code)


def _add_open_routes(app: FastAPI, metrics: RouterMetrics, is_ready: Callable[[], bool]) -> None:
    """/health and /metrics: open, whatever the API keys."""

    @app.get("/health")
    async def health() -> JSONResponse:
        ready = is_ready()
        return JSONResponse({"status": "ok" if ready else "no decode node ready"},
                            status_code=200 if ready else 503)  # fmt: skip

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)


@dataclass(frozen=True)
class _BodyLimits:
    max_bytes: int  # --max-request-bytes
    max_choices: int  # --max-choices-per-request


def _add_api_routes(
    app: FastAPI, serving: OpenAIServing, limits: _BodyLimits, api_keys: ApiKeys | None
) -> None:
    """The /v1/ routes, each behind the API keys (when there are any)."""

    def authorize(request: Request) -> None:
        """Raises OpenAIError(401) unless the request carries a listed API key (if any is)."""
        if api_keys is not None and not api_keys.check(request.headers.get("authorization")):
            raise OpenAIError(
                "send a valid API key as 'Authorization: Bearer KEY'", status=401,
                code="invalid_api_key",
            )  # fmt: skip

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        authorize(request)
        return JSONResponse(serving.models())

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        authorize(request)
        return await _generate(serving, request, parse_completion, limits)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        authorize(request)
        return await _generate(serving, request, parse_chat, limits)


async def _read_body(request: Request, max_bytes: int) -> bytes:
    """The body, refused (413) once it is known to exceed `max_bytes`: by its Content-Length,
    or while reading it."""
    too_large = OpenAIError(
        f"the request body exceeds this router's limit of {max_bytes} bytes "
        "(--max-request-bytes)", status=413,
    )  # fmt: skip
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


async def _parse(
    serving: OpenAIServing, body: bytes, parse: Callable[..., OpenAIRequest], limits: _BodyLimits
) -> OpenAIRequest:
    """`parse(parse_json(body))`: on the loop for a small body, else on the body thread."""
    info = serving.handler.registry.model_info
    work = functools.partial(
        _parse_now, body, parse, limits.max_choices, info.max_model_len if info else None
    )
    if len(body) <= INLINE_BYTES:
        return work()
    return await asyncio.get_running_loop().run_in_executor(_BODY_THREAD, work)


def _parse_now(
    body: bytes, parse: Callable[..., OpenAIRequest], max_choices: int, max_tokens: int | None
) -> OpenAIRequest:
    return parse(parse_json(body), max_choices=max_choices, max_prompt_tokens=max_tokens)


async def _generate(
    serving: OpenAIServing,
    request: Request,
    parse: Callable[..., OpenAIRequest],
    limits: _BodyLimits,
) -> Response:
    start_s = time.monotonic()
    try:
        parsed = await _parse(serving, await _read_body(request, limits.max_bytes), parse, limits)
    except OpenAIError as error:
        raise serving.reject(error, start_s) from None
    except ClientDisconnect:  # gone (or too slow: --http-body-timeout-s) before its body was in
        return Response(status_code=_CLIENT_CLOSED)
    prepared = await serving.prepare(parsed, start_s, request.headers.get("authorization"))
    if parsed.stream:
        events = await _unless_disconnected(request, serving.open_stream(prepared))
        if events is None:  # nobody to answer
            return Response(status_code=_CLIENT_CLOSED)
        return StreamingResponse(
            events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Request-Id": prepared.request_id},
        )
    body = await _unless_disconnected(request, serving.complete(prepared))
    if body is None:  # nobody to answer
        return Response(status_code=_CLIENT_CLOSED)
    return JSONResponse(body, headers={"X-Request-Id": prepared.request_id})


async def _unless_disconnected(request: Request, work: Coroutine[Any, Any, T]) -> T | None:
    """`work`'s result; None, `work` cancelled (its node calls with it), when the client
    disconnects first (a stream notices on its own, at its next write; a whole body would
    not, and the request would run to its end for nobody)."""
    task = asyncio.ensure_future(work)
    # The body is read: the next ASGI message is the client's disconnect.
    disconnect = asyncio.ensure_future(request.receive())
    try:
        await asyncio.wait((task, disconnect), return_when=asyncio.FIRST_COMPLETED)
    finally:
        disconnect.cancel()
        if not task.done():
            task.cancel()
    if task.cancelling() or task.cancelled():  # the client left first
        await asyncio.gather(task, return_exceptions=True)
        return None
    return task.result()
