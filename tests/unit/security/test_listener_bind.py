"""Issue 15: KV listeners bind the address they are given. tcp binds `host` itself; ucxx 0.52
has no bind address (its listener takes a port only), so the ucx transport passes `host` where
ucxx takes one and otherwise says plainly, at start, that the port listens on every interface
(its `caveat`, which the node's one start-up warning carries)."""

from __future__ import annotations

import asyncio

import psutil
import pytest

from cache_transfer import make_transport
from cache_transfer.transports import ucx_available

needs_ucx = pytest.mark.skipif(not ucx_available(), reason="ucxx does not import here")


def _listening_ips(port: int) -> set[str]:
    return {
        c.laddr.ip
        for c in psutil.Process().net_connections("inet")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port
    }


def _bound(name: str, host: str) -> tuple[str, set[str]]:
    return _bound_with_caveat(name, host)[:2]


def _bound_with_caveat(name: str, host: str) -> tuple[str, set[str], str | None]:
    async def scenario() -> tuple[str, set[str], str | None]:
        transport = make_transport(name, host)
        try:
            port = int(transport.address.rsplit(":", 1)[1])
            return transport.address, _listening_ips(port), transport.caveat
        finally:
            await transport.close()

    return asyncio.run(asyncio.wait_for(scenario(), 60))


def make_transport_caveat(name: str, host: str) -> str | None:
    return _bound_with_caveat(name, host)[2]


def test_tcp_listens_on_the_given_host_only() -> None:
    address, ips = _bound("tcp", "127.0.0.1")
    assert address.startswith("tcp://127.0.0.1:")
    assert ips == {"127.0.0.1"}


@needs_ucx
def test_ucx_says_when_it_cannot_bind_the_given_host() -> None:
    address, ips, caveat = _bound_with_caveat("ucx", "127.0.0.1")
    if ips == {"127.0.0.1"}:  # a ucxx that binds the host: nothing to warn about
        assert caveat is None
        return
    assert ips <= {"0.0.0.0", "::"}, ips
    assert caveat is not None and "every interface" in caveat
    assert "127.0.0.1" in caveat and "--kv-transport tcp" in caveat
    assert make_transport_caveat("tcp", "127.0.0.1") is None  # tcp binds the host


@needs_ucx
def test_ucx_passes_the_host_where_ucxx_takes_one(monkeypatch: pytest.MonkeyPatch) -> None:
    from cache_transfer.transports.ucx import transport as ucx_transport

    calls: list[dict] = []
    real = ucx_transport.ucxx.create_listener

    def create_listener(callback, port=0, host=None):  # the signature of a ucxx with a host
        calls.append({"port": port, "host": host})
        return real(callback, port)

    monkeypatch.setattr(ucx_transport.ucxx, "create_listener", create_listener)
    address, _ = _bound("ucx", "127.0.0.1")
    assert calls == [{"port": 0, "host": "127.0.0.1"}]
    assert address.startswith("ucx://127.0.0.1:")
    calls.clear()
    _bound("ucx", "0.0.0.0")  # a wildcard: ucxx's default, every interface
    assert calls == [{"port": 0, "host": None}]


@pytest.mark.parametrize("name", ["tcp", pytest.param("ucx", marks=needs_ucx)])
def test_a_port_another_listener_holds_is_still_refused(name: str) -> None:
    """SO_REUSEADDR (set so a restarted node binds through TIME_WAIT) never lets two live
    listeners share a port."""
    from cache_transfer import TransportBindError

    async def scenario() -> None:
        first = make_transport(name, "127.0.0.1")
        try:
            port = int(first.address.rsplit(":", 1)[1])
            with pytest.raises(TransportBindError):
                await make_transport(name, "127.0.0.1", port).close()
        finally:
            await first.close()

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_a_live_nodes_grpc_port_cannot_be_shared() -> None:
    """gRPC's default SO_REUSEPORT would let a second server bind a live node's port and take
    a share of its connections; pdserve's servers turn it off."""
    from node_common.grpc_node_server import GrpcNodeServer
    from pdserve.config import RouterConfig
    from router.server import RouterServer

    class Backend:
        node_info = tokenizer_files = kv_address = None

    async def scenario() -> None:
        first = GrpcNodeServer("127.0.0.1", 0, Backend(), "pdserve.v1.DecodeNode", lambda s: None)
        await first.start()
        try:
            second = GrpcNodeServer(
                "127.0.0.1", first.port, Backend(), "pdserve.v1.DecodeNode", lambda s: None
            )
            with pytest.raises(OSError):
                await second.start()
            await second.stop(0)
            router = RouterServer(RouterConfig(host="127.0.0.1", port=first.port, http_port=0))
            with pytest.raises(OSError):
                await router.start()
            await router.stop(0)
        finally:
            await first.stop(0)

    asyncio.run(asyncio.wait_for(scenario(), 60))
