"""gRPC guards for every pdserve server and client (the router's and the nodes').

```
RequestGuard(check, code)   server interceptor: a method outside `open_prefixes` (health,
                            reflection) runs only when check(method, metadata) is None, else
                            it ends with `code` (UNAUTHENTICATED) and check's reason. Every
                            unary request is parsed here: a malformed protobuf or invalid
                            UTF-8 ends INVALID_ARGUMENT (gRPC's own answer is UNKNOWN)
cluster_check(auth, names)  the nodes' check: a valid, fresh, unreplayed cluster proof made
                            for this node (one of names(): its HOST:PORT, as bound and as
                            advertised), so a proof for one node is refused by every other
client_interceptors(auth,   add a fresh cluster proof for `audience` (the node's HOST:PORT
    audience)               the channel dials) to every call (router -> node)
SERVER_OPTIONS              every server's options: no SO_REUSEPORT (no port sharing)
server_credentials(config)  mutual TLS for a server (None: no TLS)
channel_credentials(config) mutual TLS for a client channel (None: no TLS)
```
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from pathlib import Path
from typing import Any

import grpc

from pdserve.config import SecurityConfig
from pdserve.security import AUTH_METADATA_KEY, ClusterAuth

OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
# Every pdserve gRPC server's options. gRPC sets SO_REUSEPORT by default on Linux: a second
# process (a stray duplicate, or any process of the same user) could then bind a live node's
# port and take a share of its connections. Off: a held port fails to bind (the launchers retry
# for --bind-retry-s); SO_REUSEADDR stays, so a port in TIME_WAIT binds at once.
SERVER_OPTIONS = (("grpc.so_reuseport", 0),)
Check = Callable[[str, dict[str, str]], str | None]  # (method, metadata) -> why refused, or None


class RequestGuard(grpc.aio.ServerInterceptor):  # type: ignore[misc]  # grpc has no types
    def __init__(
        self,
        check: Check | None,
        code: grpc.StatusCode = grpc.StatusCode.UNAUTHENTICATED,
        open_prefixes: Sequence[str] = OPEN_PREFIXES,
    ) -> None:
        self._check = check
        self._code = code
        self._open = tuple(open_prefixes)

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        handler = await continuation(details)
        if handler is None or handler.request_streaming:
            return handler  # unknown method (UNIMPLEMENTED), or reflection's stream
        method = details.method
        method = method.decode() if isinstance(method, bytes) else method
        if self._check is not None and not method.startswith(self._open):
            metadata = {key: value for key, value in details.invocation_metadata or ()}
            reason = self._check(method, metadata)
            if reason is not None:
                return _refusing(handler, self._code, f"{method}: {reason}")
        return _parsing(handler)


def cluster_check(auth: ClusterAuth, names: Callable[[], Collection[str]]) -> Check:
    def check(method: str, metadata: dict[str, str]) -> str | None:
        return auth.check_call(method, metadata.get(AUTH_METADATA_KEY), names())

    return check


def _refusing(handler: Any, code: grpc.StatusCode, message: str) -> Any:
    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, message)

    if handler.response_streaming:
        return handler._replace(unary_stream=refuse, request_deserializer=None)
    return handler._replace(unary_unary=refuse, request_deserializer=None)


def _parsing(handler: Any) -> Any:
    """`handler` taking raw bytes: a request that does not parse ends INVALID_ARGUMENT."""
    deserialize = handler.request_deserializer
    if deserialize is None:
        return handler

    async def parse(data: bytes, context: grpc.aio.ServicerContext) -> Any:
        try:
            return deserialize(data)
        except Exception as error:  # protobuf's DecodeError, or invalid UTF-8 in a string
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the request is not a valid protobuf message ({len(data)} bytes): {error}",
            )

    if handler.response_streaming:
        stream_behavior = handler.unary_stream
        if inspect.isasyncgenfunction(stream_behavior):

            async def each(data: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                async for response in stream_behavior(await parse(data, context), context):
                    yield response

            return handler._replace(unary_stream=each, request_deserializer=None)

        async def stream(data: bytes, context: grpc.aio.ServicerContext) -> Any:
            return await stream_behavior(await parse(data, context), context)

        return handler._replace(unary_stream=stream, request_deserializer=None)
    behavior = handler.unary_unary

    async def unary(data: bytes, context: grpc.aio.ServicerContext) -> Any:
        result = behavior(await parse(data, context), context)
        return await result if inspect.isawaitable(result) else result

    return handler._replace(unary_unary=unary, request_deserializer=None)


class _ProofAdder:
    """Adds a fresh cluster proof to each call."""

    def __init__(self, auth: ClusterAuth, audience: str) -> None:
        self._auth = auth
        self._audience = audience

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        method = details.method
        method = method.decode() if isinstance(method, bytes) else method
        metadata = grpc.aio.Metadata(*(details.metadata or ()))
        metadata.add(AUTH_METADATA_KEY, self._auth.call_token(method, self._audience))
        return grpc.aio.ClientCallDetails(
            details.method, details.timeout, metadata, details.credentials,
            details.wait_for_ready,
        )  # fmt: skip


class _UnaryProofAdder(_ProofAdder, grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]  # (no types)
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _StreamProofAdder(_ProofAdder, grpc.aio.UnaryStreamClientInterceptor):  # type: ignore[misc]  # (no types)
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


def client_interceptors(auth: ClusterAuth | None, audience: str) -> list[Any]:
    """Proofs for the node `audience` names. One interceptor per call shape: grpc.aio files
    an interceptor under the first shape it implements only, so one object serving both would
    leave streaming calls (Prefill, Decode) without a proof."""
    if auth is None:
        return []
    return [_UnaryProofAdder(auth, audience), _StreamProofAdder(auth, audience)]


def _read(path: str | None) -> bytes | None:
    return None if path is None else Path(path).read_bytes()


def server_credentials(config: SecurityConfig) -> grpc.ServerCredentials | None:
    """Mutual TLS: this server presents tls_cert and requires a client certificate that
    chains to tls_ca. None without TLS."""
    if not config.tls:
        return None
    return grpc.ssl_server_credentials(
        [(_read(config.tls_key), _read(config.tls_cert))],
        root_certificates=_read(config.tls_ca),
        require_client_auth=True,
    )


def channel_credentials(config: SecurityConfig) -> grpc.ChannelCredentials | None:
    if not config.tls:
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=_read(config.tls_ca),
        private_key=_read(config.tls_key),
        certificate_chain=_read(config.tls_cert),
    )


def open_channel(
    address: str,
    config: SecurityConfig,
    auth: ClusterAuth | None,
    options: Sequence[tuple[str, Any]] = (),
) -> grpc.aio.Channel:
    """A client channel to a pdserve node: TLS when configured, a cluster proof on each call
    (made for the node at `address`)."""
    interceptors = client_interceptors(auth, address)
    credentials = channel_credentials(config)
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
    return grpc.aio.secure_channel(address, credentials, options=options, interceptors=interceptors)


def bind(server: grpc.aio.Server, address: str, config: SecurityConfig) -> int:
    """`server.add_*_port(address)` as the config says; the bound port."""
    credentials = server_credentials(config)
    port: int = (
        server.add_insecure_port(address)
        if credentials is None
        else server.add_secure_port(address, credentials)
    )
    return port
