"""Issue 39, item 1 (optional part): `--kv-encrypt` on the nodes. A secured cluster with it
serves the tokens an unencrypted one does; a node refuses it without a cluster secret. Real
prefill and decode nodes and a real router in this process, tcp KV transport."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.config import SecurityConfig
from tests.unit.decode_node.node_harness import run, running_nodes
from tests.unit.security.test_kv_handoff_hijack import generate, routed

pytestmark = pytest.mark.timeout(180)


def test_an_encrypted_cluster_serves_the_same_tokens(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("a-cluster-secret-0123456789abcdef\n")
    security = SecurityConfig(cluster_secret_file=str(secret))

    async def tokens(encrypt: bool) -> tuple[list[int], int]:
        async with running_nodes(
            "tcp", security=security, check_free=False, kv_encrypt=encrypt
        ) as nodes:
            async with routed(nodes, security) as client:
                result = await generate(client)
            return result, nodes.decode.manager.num_succeeded

    (plain, _), (encrypted, handed_off) = run(tokens(False)), run(tokens(True))
    assert encrypted == plain and handed_off == 1


def test_kv_encrypt_needs_a_cluster_secret() -> None:
    async def start() -> None:
        async with running_nodes("tcp", kv_encrypt=True):
            pass

    with pytest.raises(ValueError, match="--kv-encrypt needs --cluster-secret-file"):
        run(start())
