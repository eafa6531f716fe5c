"""`UcxTransport`: the KV transport on UCX (ucxx), for host and CUDA memory alike.

    peer UcxOutbound ──tagged UCX messages──► our listener ──► UcxInbound ──► handler
    our UcxOutbound per peer address (created on first send, reused) ──► peer listener

UCX picks the wire per message: cuda_ipc (NVLink) between GPUs of one host, RDMA between hosts
where it exists, tcp otherwise; CUDA payloads are sent and received in place, never staged
through the host. Framing (wire.py): every message is numbered on its connection and its
parts are tagged with that number, so one connection carries any number of messages at once
(no lock: a layer never waits behind another transfer's layer) and the receiver still takes
them in call order. A broken connection fails the messages in flight on both ends: sends raise
TransportError, payloads half received are abandoned, and the sessions they belong to fail
(or time out, for those with nothing in flight).

The listener binds `host` when ucxx's `create_listener` takes a `host` (UCXX's C++
ListenerBuilder has one); ucxx 0.52's Python API has none and listens on every interface, so
then a specific `host` gets a warning at start (the port is reachable on every interface: only
KV handshakes proving the cluster secret are heard, and an unauthenticated peer allocates
nothing; firewall it, or use the tcp transport, which binds `host`): the transport's `caveat`,
which the node puts in its one start-up warning. `host` also chooses the address advertised to
peers.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Sequence

import torch

from cache_transfer.transports.base import (
    KVTransport,
    Message,
    TransportBindError,
    TransportError,
    TransportHandler,
    check_messages,
)
from cache_transfer.transports.ucx.inbound import UcxInbound
from cache_transfer.transports.ucx.outbound import UcxOutbound
from cache_transfer.transports.ucx.runtime import RUNTIME, ucxx
from pdserve.net import WILDCARD_HOSTS, bracket, dial_host

logger = logging.getLogger(__name__)

SCHEME = "ucx://"


class UcxTransport(KVTransport):
    def __init__(self, host: str = "127.0.0.1", port: int = 0, advertise_host: str | None = None):
        """Listen on `port` (0: a free one) and advertise `advertise_host` (default: `host`, or
        this machine's address when `host` is a wildcard). Build it inside the running event
        loop that will use it: UCX completes its requests there (see runtime.py)."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            raise RuntimeError(
                "build UcxTransport inside the running event loop that will use it"
            ) from None
        RUNTIME.acquire(self)
        try:
            self._listener, self.caveat = _listen(self._on_connect, host, port)
        except Exception as error:  # e.g. "Device is busy": the port is still held
            RUNTIME.forget(self)
            raise TransportBindError(
                f"cannot listen for KV (ucx) on port {port}: {error}"
            ) from error
        host = advertise_host or dial_host(host)
        self._address = f"{SCHEME}{bracket(host)}:{self._listener.port}"
        self._handler: TransportHandler | None = None
        self._outbound: dict[str, UcxOutbound] = {}
        self._inbound: set[UcxInbound] = set()
        self._serving: set[asyncio.Task[None]] = set()  # our listener callbacks still running
        self._closed = False

    @property
    def address(self) -> str:
        return self._address

    def start(self, handler: TransportHandler) -> None:
        if self._handler is not None:
            raise RuntimeError(f"transport {self._address} was already started")
        self._handler = handler

    async def send_many(self, peer_address: str, messages: Sequence[Message]) -> None:
        check_messages(messages)
        if self._closed:
            raise TransportError(f"transport {self._address} is closed")
        messages = [(bytes(header), payload) for header, payload in messages]
        task = self._connection(peer_address).submit(messages)  # ValueError: head too large
        await asyncio.shield(task)  # the send goes on (owning its buffers) if our caller leaves

    def buffer_device(self, cache_device: torch.device) -> torch.device:
        return cache_device

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        outbound = list(self._outbound.values())
        self._outbound.clear()
        for inbound in self._inbound:
            inbound.close()
        await asyncio.gather(*(connection.close() for connection in outbound))
        if self._serving:
            await asyncio.wait(set(self._serving))
        self._listener.close()
        await RUNTIME.release(self)

    def _connection(self, peer_address: str) -> UcxOutbound:
        """The live connection to `peer_address`, opening a new one after a failure."""
        connection = self._outbound.get(peer_address)
        if connection is None or connection.failed:
            host, port = _parse_address(peer_address)
            connection = UcxOutbound(self._address, peer_address, host, port)
            self._outbound[peer_address] = connection
        return connection

    async def _on_connect(self, endpoint: ucxx.Endpoint) -> None:
        """The listener's callback: serve one incoming connection until it ends."""
        if self._closed or self._handler is None:
            endpoint.abort()
            return
        task = asyncio.current_task()
        assert task is not None
        inbound = UcxInbound(endpoint, self._handler, self._name_peer)
        self._inbound.add(inbound)
        self._serving.add(task)
        try:
            await inbound.run()
        finally:
            self._inbound.discard(inbound)
            self._serving.discard(task)

    def connection_id(self, peer_address: str) -> str:
        return self._connection(peer_address).name

    def _name_peer(self, name: str) -> str:
        """The peer_id of a connection whose hello says `name` (its sender's address and a
        random suffix); ValueError, the connection closed, when a live one has it already."""
        if any(inbound.peer_id == name for inbound in self._inbound):
            raise ValueError(f"a live connection is named {name!r} already")
        return name


def _listen(callback: object, host: str, port: int) -> tuple[ucxx.Listener, str | None]:
    """A ucxx listener on `host`:`port` where ucxx can bind an address; else on every
    interface, and what to say about it when `host` is a specific address."""
    if host in WILDCARD_HOSTS:
        return ucxx.create_listener(callback, port), None
    if "host" in inspect.signature(ucxx.create_listener).parameters:
        return ucxx.create_listener(callback, port, host=host), None
    listener = ucxx.create_listener(callback, port)
    caveat = (
        f"its ucx KV port {listener.port} listens on every interface, not only {host} (ucxx "
        f"{getattr(ucxx, '__version__', '?')} binds no address): firewall it, or use "
        f"--kv-transport tcp to listen on {host} only"
    )
    return listener, caveat


def _parse_address(address: str) -> tuple[str, int]:
    """(host, port) of "ucx://host:port" (an IPv6 host in brackets)."""
    host, sep, port = address.removeprefix(SCHEME).rpartition(":")
    if not address.startswith(SCHEME) or not sep or not port.isdigit() or not host:
        raise TransportError(f"ucx transport cannot reach {address!r}: expected ucx://HOST:PORT")
    return host.strip("[]"), int(port)
