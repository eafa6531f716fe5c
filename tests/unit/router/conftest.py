"""Fixtures of the router tests: the fake model's tokenizer, as node files and as a Tokenizer;
a Redis server for the registry tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from router_fakes import build_tokenizer_files

from pdserve.tokenizer import Tokenizer
from pdserve.v1 import node_pb2
from router.node_client import tokenizer_from_files
from tests.redis_server import RedisServer


@pytest.fixture(scope="session")
def tokenizer_files(tmp_path_factory) -> node_pb2.TokenizerFiles:
    return build_tokenizer_files(tmp_path_factory.mktemp("router-tokenizer"))


@pytest.fixture(scope="session")
def tokenizer(tokenizer_files) -> Tokenizer:
    """The tokenizer the router builds from the nodes' files."""
    return tokenizer_from_files(tokenizer_files, "fake-model")


@pytest.fixture
def redis_server(tmp_path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.kill()
