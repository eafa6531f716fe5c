"""tests/ports.py: a start that lost its port to another process is retried on a fresh one;
any other failure is not; a held unlistened port refuses connections."""

from __future__ import annotations

import asyncio
import errno
import socket

import pytest

from pdserve.port_reservations import PortReservations
from tests.ports import (
    free_port,
    port_was_taken,
    start_on_free_ports,
    start_on_free_ports_async,
    unlistened_port,
)


def test_a_start_whose_port_was_taken_runs_again_on_a_fresh_port() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        ports = [taken.getsockname()[1]]  # what the first start "picked", taken meanwhile
        bound: list[socket.socket] = []

        def start() -> int:
            port = ports.pop(0) if ports else free_port()
            sock = socket.socket()
            sock.bind(("127.0.0.1", port))  # EADDRINUSE the first time
            bound.append(sock)
            return port

        port = start_on_free_ports(start)
        assert port != taken.getsockname()[1] and len(bound) == 1
        bound[0].close()


def test_other_failures_are_raised_at_once_and_the_last_attempt_s_too() -> None:
    calls: list[int] = []

    def fails(error: Exception):
        def start() -> None:
            calls.append(1)
            raise error

        return start

    with pytest.raises(ValueError):
        start_on_free_ports(fails(ValueError("no model")))
    assert len(calls) == 1
    calls.clear()
    with pytest.raises(OSError):
        start_on_free_ports(fails(OSError(errno.EADDRINUSE, "Address already in use")), 3)
    assert len(calls) == 3
    calls.clear()

    async def taken_then_up() -> str:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("pd-serve did not start: ... [Errno 98] Address already in use")
        return "up"

    assert asyncio.run(start_on_free_ports_async(taken_then_up)) == "up" and len(calls) == 2


def test_pd_serve_s_own_message_for_a_taken_port_counts() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        with pytest.raises(OSError) as error:
            PortReservations("127.0.0.1").reserve(taken.getsockname()[1], "x", "--x N")
    assert port_was_taken(error.value)
    assert not port_was_taken(RuntimeError("cannot load the model 'x'"))


def test_an_unlistened_port_refuses_connections_while_held() -> None:
    with unlistened_port() as port, pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
