"""Issue 34: pd-serve holds every fixed port it will use before any node starts; a taken one
fails it in seconds (not after the nodes loaded the model), naming the port and the flag that
moves it. A child killed by a signal is reported by the signal's name."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import pytest

from pdserve.local_cluster import describe_exit
from pdserve.port_reservations import PortReservations, PortTaken
from tests.ports import free_port, start_on_free_ports

FAIL_WITHIN_S = 8.0  # the acceptance bound for `make serve` with port 8000 taken


def _listener() -> socket.socket:
    """Another program's server on a free port of 127.0.0.1."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    return sock


def test_a_reserved_port_is_held_until_released() -> None:
    reservations = PortReservations("127.0.0.1")

    def reserve_a_free_port() -> int:  # (another, if one is taken before it is held)
        port = free_port()
        reservations.reserve(port, "the router's HTTP API", "--http-port N")
        return port

    port = start_on_free_ports(reserve_a_free_port)
    with pytest.raises(OSError), socket.socket() as other:
        other.bind(("127.0.0.1", port))  # held: nobody else gets it meanwhile
        other.listen(1)
    reservations.release([port])
    with socket.socket() as server:  # the process that serves it binds it now
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", port))
    reservations.reserve(0, "a free port", "--port N")  # 0: nothing to hold


def test_a_taken_port_names_the_port_and_the_flag() -> None:
    with _listener() as taken:
        port = taken.getsockname()[1]
        with pytest.raises(PortTaken) as error:
            PortReservations("127.0.0.1").reserve(port, "the router's HTTP API", "--http-port N")
    message = str(error.value)
    assert f"port {port}" in message and "--http-port N" in message and "HTTP API" in message


@pytest.mark.parametrize("flag", ["--http-port", "--port", "--metrics-port"])
def test_pd_serve_with_a_taken_port_exits_at_once(flag: str) -> None:
    """Before any node process starts (none is spawned: it would take a minute to load)."""
    with _listener() as taken:
        port = taken.getsockname()[1]
        argv = [sys.executable, "-m", "pdserve.local_cluster", "--port", "0", "--http-port", "0"]
        argv += [flag, str(port)]
        start_s = time.monotonic()
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
        took_s = time.monotonic() - start_s
    assert done.returncode != 0
    assert took_s < FAIL_WITHIN_S, took_s
    assert f"port {port}" in done.stderr and flag in done.stderr, done.stderr
    assert "started 1 decode" not in done.stderr  # no node was started


def test_a_child_killed_by_a_signal_is_named() -> None:
    assert describe_exit(-signal.SIGKILL).startswith("killed by SIGKILL (out of memory?")
    assert describe_exit(-signal.SIGTERM) == "killed by SIGTERM"
    assert describe_exit(2) == "exited with code 2"
