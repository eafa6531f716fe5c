"""pd-prefill: serves once it prints its one listening line, stops cleanly on SIGTERM."""

from __future__ import annotations

import signal
import tomllib
from pathlib import Path

import grpc
import pytest

from node_common.launcher import build_node_parser
from pdserve.v1 import node_pb2, node_pb2_grpc
from prefill_node.prefill_server import PrefillServer
from tests.unit.decode_node.node_harness import RPC_TIMEOUT_S, NodeProcess

pytestmark = pytest.mark.timeout(300)


def test_console_script_is_declared() -> None:
    pyproject = tomllib.loads((Path(__file__).parents[3] / "pyproject.toml").read_text())
    assert pyproject["project"]["scripts"]["pd-prefill"] == "prefill_node.cli:main"


def test_parser_has_the_shared_node_flags() -> None:
    args = build_node_parser(PrefillServer).parse_args(
        ["--kv-transport", "tcp", "--kv-port", "5600"]
    )
    assert (args.port, args.kv_transport, args.kv_port, args.host) == (0, "tcp", 5600, "127.0.0.1")


def test_pd_prefill_serves_then_stops_on_sigterm() -> None:
    node = NodeProcess.launch("prefill_node.cli", "--kv-transport", "tcp")
    try:
        assert node.match[1] == "pd-prefill"
        assert node.match[2] == "127.0.0.1" and int(node.match[3]) > 0
        assert node.match[4].startswith("tcp://127.0.0.1:")
        with grpc.insecure_channel(node.address) as channel:
            info = node_pb2_grpc.NodeStub(channel).GetNodeInfo(
                node_pb2.GetNodeInfoRequest(), timeout=RPC_TIMEOUT_S
            )
        assert info.role == node_pb2.NODE_ROLE_PREFILL and info.kv_transport == "tcp"
    finally:
        returncode, rest = node.stop(signal.SIGTERM)
    assert returncode == 0
    assert rest == ""  # exactly one line on stdout
