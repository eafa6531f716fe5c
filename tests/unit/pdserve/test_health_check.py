"""`python -m pdserve.health_check` (the image's HEALTHCHECK) against a real health service."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdserve import health_check
from tests.ports import unlistened_port


@pytest.fixture
def health_server():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", servicer
    server.stop(None)


def test_serving_exits_0(health_server) -> None:
    address, servicer = health_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    assert health_check.check(address) is None
    assert health_check.main([address]) == 0


def test_not_serving_exits_1_and_says_so(health_server, capsys) -> None:
    address, servicer = health_server
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert health_check.main([address]) == 1
    assert "NOT_SERVING" in capsys.readouterr().err


def test_nothing_listening_is_unavailable() -> None:
    with unlistened_port() as port:  # held: nobody can start to listen there meanwhile
        problem = health_check.check(f"127.0.0.1:{port}", timeout_s=2)
    assert problem is not None and "UNAVAILABLE" in problem


def test_unknown_service_is_not_serving(health_server) -> None:
    address, servicer = health_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    problem = health_check.check(address, service="no.such.Service")
    assert problem is not None and "NOT_FOUND" in problem
