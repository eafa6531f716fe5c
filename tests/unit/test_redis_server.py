"""The tests' throwaway redis-server (tests/redis_server.py): a port it picked that another
process took before redis bound it (parallel test workers) is replaced; a restart keeps its
port."""

from __future__ import annotations

import socket

import pytest

from tests.redis_server import RedisServer

pytestmark = pytest.mark.skipif(
    not __import__("shutil").which("redis-server"), reason="needs redis-server on PATH"
)


def test_a_picked_port_taken_meanwhile_is_replaced_and_a_restart_keeps_its_port(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))  # bound, not listening: refuses connections
        server = RedisServer(tmp_path / "redis")
        server.port = taken.getsockname()[1]  # as if another process took it first
        try:
            server.start()
            assert server.port != taken.getsockname()[1]
            with server.client() as client:
                assert client.ping()
            port = server.port
            server.restart()
            assert server.port == port
        finally:
            server.kill()


def test_a_port_given_by_the_caller_is_never_replaced(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        server = RedisServer(tmp_path / "redis", port=taken.getsockname()[1])
        with pytest.raises(RuntimeError, match="redis-server did not start"):
            server.start()
