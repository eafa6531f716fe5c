"""pd-decode: serves once it prints its one listening line, stops cleanly on SIGINT; a KV
transport it cannot build is an error, exit 1."""

from __future__ import annotations

import signal
import subprocess
import sys
import tomllib
from pathlib import Path

import grpc
import pytest

from decode_node.decode_server import DecodeServer
from node_common.launcher import build_node_parser
from pdserve.config import NodeConfig, RouterConfig
from pdserve.v1 import node_pb2, node_pb2_grpc
from router.cli import build_router_parser
from tests.unit.decode_node.node_harness import LAUNCH_TIMEOUT_S, RPC_TIMEOUT_S, NodeProcess

pytestmark = pytest.mark.timeout(300)


def test_console_script_is_declared() -> None:
    pyproject = tomllib.loads((Path(__file__).parents[3] / "pyproject.toml").read_text())
    assert pyproject["project"]["scripts"]["pd-decode"] == "decode_node.cli:main"


def test_parser_adds_transfer_timeout_with_the_one_default_every_role_shares() -> None:
    parser = build_node_parser(DecodeServer)
    default = parser.parse_args([]).transfer_timeout_s
    assert default == NodeConfig().transfer_timeout_s == RouterConfig().transfer_timeout_s
    assert build_router_parser().parse_args(["--decode", "h:1"]).transfer_timeout_s == default
    assert parser.parse_args(["--transfer-timeout-s", "2.5"]).transfer_timeout_s == 2.5


def test_pd_decode_serves_then_stops_on_sigint() -> None:
    node = NodeProcess.launch(
        "decode_node.cli", "--kv-transport", "tcp", "--transfer-timeout-s", "3"
    )
    try:
        assert node.match[1] == "pd-decode"
        assert node.match[4].startswith("tcp://127.0.0.1:")
        with grpc.insecure_channel(node.address) as channel:
            stats = node_pb2_grpc.NodeStub(channel).GetStats(
                node_pb2.GetStatsRequest(), timeout=RPC_TIMEOUT_S
            )
        assert stats.num_kv_blocks == 16 == stats.num_free_kv_blocks
    finally:
        returncode, rest = node.stop(signal.SIGINT)
    assert returncode == 0
    assert rest == ""


def test_unknown_model_exits_1_with_a_message() -> None:
    argv = [sys.executable, "-m", "decode_node.cli", "--model", "/nonexistent/no-such-model"]
    argv += ["--device", "cpu", "--log-level", "error"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    assert done.returncode == 1
    assert (
        "pd-decode: model '/nonexistent/no-such-model' is neither an existing path" in done.stderr
    )
    assert done.stdout == ""


def test_a_tensor_parallel_size_that_does_not_split_the_model_is_refused(capsys) -> None:
    """Nodes serve --tensor-parallel-size N (their hand-off sends every rank's heads); a size
    the model's heads do not divide is refused before any rank starts, naming the sizes."""
    from node_common.launcher import run_node

    argv = ["--model", "synthetic:tiny-llama", "--tensor-parallel-size", "3", "--device", "cpu"]
    assert run_node(DecodeServer, [*argv, "--port", "0", "--kv-transport", "tcp"]) == 1
    err = capsys.readouterr().err
    assert "tensor_parallel_size 3 does not split" in err and "Sizes that work: 1, 2, 4" in err
