"""`check_decode_request`: what a `Decode` call must satisfy before anything is reserved for it
(its mode, request id, transfer timeout, a migration's mode, then the checks every node runs:
node_common/node_messages.check_request); the call ends INVALID_ARGUMENT otherwise."""

from __future__ import annotations

import grpc

from engine.async_engine import AsyncEngine
from node_common.node_messages import check_request
from pdserve.sampling_params import SamplingParams
from pdserve.v1 import node_pb2

MODES = (node_pb2.DECODE_MODE_DISAGGREGATED, node_pb2.DECODE_MODE_LOCAL_PREFILL)


async def check_decode_request(
    engine: AsyncEngine, request: node_pb2.DecodeRequest, context: grpc.aio.ServicerContext
) -> SamplingParams:
    """The request's sampling parameters, once every check that needs no grammar passed."""
    if request.mode not in MODES:
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
