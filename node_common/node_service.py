"""`NodeServicer`: the `Node` service every node serves, over a `NodeBackend`.

    GetNodeInfo  ──► backend.node_info               (fixed for the node's life)
    GetStats     ──► await backend.stats()
    GetTokenizer ──► backend.tokenizer_files
    Abort        ──► await backend.abort(request_id)

Torch- and engine-free: each role (prefill_node, decode_node) implements the backend from its
engine and transfer manager; the two roles may not import each other, so this is where the
shared part lives.
"""

from __future__ import annotations

from typing import Protocol

import grpc

from pdserve.v1 import node_pb2, node_pb2_grpc


class NodeBackend(Protocol):
    """What a role hands the `Node` service."""

    @property
    def node_info(self) -> node_pb2.NodeInfo: ...

    @property
    def tokenizer_files(self) -> node_pb2.TokenizerFiles: ...

    @property
    def kv_address(self) -> str:
        """Where peers reach this node's KV transport (for the registry record)."""
        ...

    async def stats(self, fresh: bool = True) -> node_pb2.NodeStats:
        """`fresh=False`: without waiting for the engine (its last step's figures)."""
        ...

    async def abort(self, request_id: str) -> bool:
        """End the request wherever it is on this node; False when the node holds no such
        request."""
        ...


class NodeServicer(node_pb2_grpc.NodeServicer):
    def __init__(self, backend: NodeBackend) -> None:
        self._backend = backend

    async def GetNodeInfo(
        self, request: node_pb2.GetNodeInfoRequest, context: grpc.aio.ServicerContext
    ) -> node_pb2.NodeInfo:
        return self._backend.node_info

    async def GetStats(
        self, request: node_pb2.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> node_pb2.NodeStats:
        return await self._backend.stats()

    async def GetTokenizer(
        self, request: node_pb2.GetTokenizerRequest, context: grpc.aio.ServicerContext
    ) -> node_pb2.TokenizerFiles:
        return self._backend.tokenizer_files

    async def Abort(
        self, request: node_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> node_pb2.AbortResponse:
        if not request.request_id:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "Abort needs the request_id to end"
            )
        return node_pb2.AbortResponse(found=await self._backend.abort(request.request_id))
