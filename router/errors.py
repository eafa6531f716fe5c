"""RouterError: a failure the client sees as one gRPC status; node failures mapped to it.

A client never sees where the cluster's nodes are: `message` (the status details, the HTTP
error's message) has every address in it replaced by ADDRESS; `detail` (what the router logs)
keeps them.
"""

from __future__ import annotations

import re
from typing import NoReturn

import grpc

# Node statuses the client gets as they are; any other node failure is INTERNAL.
_KEPT_CODES = frozenset(
    {
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNAVAILABLE,
    }
)


ADDRESS = "<address>"
_ADDRESSES = re.compile(
    r"\b(?:tcp|ucx|redis|rediss|unix|http|https)://[^\s,;)]+"  # transport / registry URLs
    r"|\[[0-9A-Fa-f:.%]+\](?::\d{1,5})?"  # [IPv6](:port)
    r"|\b\d{1,3}(?:\.\d{1,3}){3}(?::\d{1,5})?\b"  # IPv4(:port)
    r"|\b[A-Za-z][\w.-]*:\d{2,5}\b"  # host:port
)


def redact_addresses(text: str) -> str:
    """`text` with every network address in it (a node's, a peer's) as ADDRESS."""
    return _ADDRESSES.sub(ADDRESS, text)


class RouterError(Exception):
    """Ends a request with `code` and `message` (the gRPC status details: addresses redacted);
    `detail` is the message as given, for the router's log."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.detail = message
        self.message = redact_addresses(message)


async def abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
    """`context.abort(code, message)`: ends the call by raising (what grpc.aio does; said here
    because grpc ships no types)."""
    await context.abort(code, message)
    raise AssertionError("grpc.aio's ServicerContext.abort returned instead of raising")


def node_error(role: str, address: str, error: grpc.aio.AioRpcError) -> RouterError:
    """A node call's failure as the client's status, naming the node."""
    code = error.code()
    message = f"{role} node {address}: {code.name}: {error.details() or 'no details'}"
    return RouterError(code if code in _KEPT_CODES else grpc.StatusCode.INTERNAL, message)


class NodeUnreachableError(RouterError):
    """A node call failed with UNAVAILABLE before the client got any token of the request:
    running it elsewhere is safe."""

    def __init__(self, message: str) -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE, message)


class DecodeLostError(RouterError):
    """The decode node failed with UNAVAILABLE after the client got some of the request's
    tokens: the dispatcher migrates the request (prompt + those tokens) to another one."""

    def __init__(self, message: str, num_output_tokens: int) -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE, message)
        self.num_output_tokens = num_output_tokens
