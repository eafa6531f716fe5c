"""A `Decode` call's request, read before anything is reserved.

```
check_decode_request(engine, request, context) -> SamplingParams
    mode, request id, transfer timeout, a migration's output only with LOCAL_PREFILL, then the
    prompt and sampling (check_request); a bad one: INVALID_ARGUMENT with the reason
prefix_lookup(engine, request, params) -> Request | None
    what a suffix reservation looks up in the prefix cache (KVSuffix): the prompt with its
    cache salt, hashed here rather than on the engine thread; no grammar (a lookup plays no
    part in decoding); None when the engine refuses it (the Decode's own request says why)
```
"""

from __future__ import annotations

import dataclasses

import grpc

from engine.async_engine import AsyncEngine
from engine.request import Request
from node_common.node_messages import check_request
from pdserve.sampling_params import SamplingParams
from pdserve.v1 import node_pb2


async def check_decode_request(
    engine: AsyncEngine, request: node_pb2.DecodeRequest, context: grpc.aio.ServicerContext
) -> SamplingParams:
    modes = (node_pb2.DECODE_MODE_DISAGGREGATED, node_pb2.DECODE_MODE_LOCAL_PREFILL)
    if request.mode not in modes:
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"mode must be DECODE_MODE_DISAGGREGATED or DECODE_MODE_LOCAL_PREFILL, got "
            f"{node_pb2.DecodeMode.Name(request.mode)}",
        )
    if not request.request_id:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is empty")
    if request.transfer_timeout_s < 0:
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"transfer_timeout_s must be >= 0 (0: the node's default), got "
            f"{request.transfer_timeout_s}",
        )
    if request.output_token_ids and request.mode != node_pb2.DECODE_MODE_LOCAL_PREFILL:
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            "output_token_ids (a migrated request) needs DECODE_MODE_LOCAL_PREFILL",
        )
    return await check_request(engine, request, context, request.output_token_ids)


def prefix_lookup(
    engine: AsyncEngine, request: node_pb2.DecodeRequest, params: SamplingParams
) -> Request | None:
    """See the module doc."""
    try:
        lookup = engine.make_request(
            request.request_id, request.prompt_token_ids,
            dataclasses.replace(params, structured_output=None), request.cache_salt,
        )  # fmt: skip
    except ValueError:
        return None
    engine.hash_prompt_ahead(lookup)
    return lookup
