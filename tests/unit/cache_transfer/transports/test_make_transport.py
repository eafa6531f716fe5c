"""make_transport: "auto" picks ucx where ucxx imports, else tcp; listeners advertise the host
peers must dial; bad names and misuse are clear errors."""

from __future__ import annotations

import pytest
from transfer_helpers import run

from cache_transfer import TransportError, make_transport, transports
from cache_transfer.transports import ucx_available

needs_ucx = pytest.mark.skipif(not ucx_available(), reason="ucxx does not import here")


def _address_of(*args: object, **kwargs: object) -> str:
    async def scenario() -> str:
        built = make_transport(*args, **kwargs)  # type: ignore[arg-type]
        address = built.address
        await built.close()
        return address

    return run(scenario())


@needs_ucx
def test_auto_is_ucx_when_ucxx_imports() -> None:
    assert _address_of("auto").startswith("ucx://127.0.0.1:")


def test_auto_falls_back_to_tcp_without_ucxx(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transports, "ucx_available", lambda: False)
    assert _address_of("auto").startswith("tcp://127.0.0.1:")
    with pytest.raises(ValueError, match="needs the `ucxx` package"):
        make_transport("ucx")


@pytest.mark.parametrize("name", ["tcp", pytest.param("ucx", marks=needs_ucx)])
def test_a_wildcard_listener_advertises_the_given_host(name: str) -> None:
    address = _address_of(name, "0.0.0.0", advertise_host="10.1.2.3")
    assert address.startswith(f"{name}://10.1.2.3:")
    assert int(address.rsplit(":", 1)[1]) > 0


def test_unknown_transport_names_the_choices() -> None:
    with pytest.raises(ValueError, match="unknown KV transport 'rdma'; choose one of auto, ucx"):
        make_transport("rdma")


@needs_ucx
def test_ucx_refuses_addresses_it_cannot_dial_and_oversized_headers() -> None:
    async def scenario() -> None:
        ucx = make_transport("ucx")
        with pytest.raises(TransportError, match="expected ucx://HOST:PORT"):
            await ucx.send("tcp://127.0.0.1:5000", b"x")
        with pytest.raises(ValueError, match="exceeds the ucx transport's"):
            await ucx.send(ucx.address, bytes(70_000))
        await ucx.close()

    run(scenario())


@needs_ucx
def test_ucx_must_be_built_inside_the_event_loop() -> None:
    with pytest.raises(RuntimeError, match="inside the running event loop"):
        make_transport("ucx")
