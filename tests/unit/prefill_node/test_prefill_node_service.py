"""The Node service on both roles (GetNodeInfo, GetStats, GetTokenizer), grpc.health.v1, and
role services answering UNIMPLEMENTED on the other role's node."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pdserve.v1 import node_pb2, node_pb2_grpc
from router.node_client import tokenizer_from_files
from tests.unit.decode_node.node_harness import (
    BLOCK_SIZE,
    MODEL,
    NUM_BLOCKS,
    RPC_TIMEOUT_S,
    TRANSPORTS,
    decode_request,
    run,
    running_nodes,
)

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_node_info_matches_between_roles(transport: str) -> None:
    async def main() -> None:
        async with running_nodes(transport) as nodes:
            request = node_pb2.GetNodeInfoRequest()
            prefill = await nodes.prefill_node_stub.GetNodeInfo(request, timeout=RPC_TIMEOUT_S)
            decode = await nodes.decode_node_stub.GetNodeInfo(request, timeout=RPC_TIMEOUT_S)
            assert prefill.role == node_pb2.NODE_ROLE_PREFILL
            assert decode.role == node_pb2.NODE_ROLE_DECODE
            for info in (prefill, decode):
                assert info.model_name == MODEL
                assert info.layout_hash == nodes.decode.layout.layout_hash()
                assert info.max_model_len == 1024
                assert info.vocab_size == 512
                assert list(info.eos_token_ids) == [2]
                assert info.block_size == BLOCK_SIZE
                assert info.kv_transport == transport
                assert info.protocol_version == 8  # PROTOCOL_VERSION_CURRENT (suffix hand-offs)
            prefill_stats, decode_stats = await nodes.stats()
            for stats in (prefill_stats, decode_stats):
                assert stats.num_kv_blocks == NUM_BLOCKS
                assert stats.num_free_kv_blocks == NUM_BLOCKS

    run(main())


def test_health_and_role_services() -> None:
    async def main() -> None:
        async with running_nodes("local") as nodes:
            for server, role_service in (
                (nodes.prefill, "pdserve.v1.PrefillNode"),
                (nodes.decode, "pdserve.v1.DecodeNode"),
            ):
                async with grpc.aio.insecure_channel(server.address) as channel:
                    stub = health_pb2_grpc.HealthStub(channel)
                    for service in ("", "pdserve.v1.Node", role_service):
                        response = await stub.Check(
                            health_pb2.HealthCheckRequest(service=service), timeout=RPC_TIMEOUT_S
                        )
                        assert response.status == health_pb2.HealthCheckResponse.SERVING
            # each role serves only its own service
            wrong = node_pb2_grpc.PrefillNodeStub(nodes.channels[1]).Prefill(
                node_pb2.PrefillRequest(), timeout=RPC_TIMEOUT_S
            )
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await asyncio.wait_for(wrong.read(), RPC_TIMEOUT_S)
            assert error.value.code() == grpc.StatusCode.UNIMPLEMENTED
            wrong = node_pb2_grpc.DecodeNodeStub(nodes.channels[0]).Decode(
                decode_request("w", [5, 6]), timeout=RPC_TIMEOUT_S
            )
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await asyncio.wait_for(wrong.read(), RPC_TIMEOUT_S)
            assert error.value.code() == grpc.StatusCode.UNIMPLEMENTED

    run(main())


def test_synthetic_model_has_empty_tokenizer_files() -> None:
    async def main() -> None:
        async with running_nodes("local") as nodes:
            request = node_pb2.GetTokenizerRequest()
            for stub in (nodes.prefill_node_stub, nodes.decode_node_stub):
                files = await stub.GetTokenizer(request, timeout=RPC_TIMEOUT_S)
                assert files == node_pb2.TokenizerFiles()

    run(main())


def test_tokenizer_files_of_a_model_folder(tmp_path: Path) -> None:
    """A Hugging Face folder with a tokenizer: the node returns its files byte for byte and
    its chat template, and the router builds a working tokenizer from them."""
    from tests.unit.engine.conftest import build_tiny_checkpoint
    from tests.unit.pdserve.text_fixtures import CHATML_TEMPLATE, build_byte_level_tokenizer

    folder = build_tiny_checkpoint("llama", tmp_path / "tiny-llama")
    build_byte_level_tokenizer(folder)

    def config(prefill_only: bool) -> EngineConfig:
        return EngineConfig(
            model=ModelConfig(model=str(folder), device="cpu", dtype="float32"),
            cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=16),
            scheduler=SchedulerConfig(prefill_only=prefill_only),
        )

    async def main() -> None:
        async with running_nodes(
            "local", prefill_engine=config(True), decode_engine=config(False)
        ) as nodes:
            request = node_pb2.GetTokenizerRequest()
            files = await nodes.prefill_node_stub.GetTokenizer(request, timeout=RPC_TIMEOUT_S)
            assert files.tokenizer_json == (folder / "tokenizer.json").read_bytes()
            assert files.tokenizer_config_json == (folder / "tokenizer_config.json").read_bytes()
            assert files.chat_template == CHATML_TEMPLATE
            decode_files = await nodes.decode_node_stub.GetTokenizer(request, timeout=RPC_TIMEOUT_S)
            assert decode_files == files
            tokenizer = tokenizer_from_files(files, "tiny-llama")
            assert tokenizer.decode(tokenizer.encode("hello world")) == "hello world"

    run(main())
