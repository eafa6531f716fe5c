"""The registry schema: NodeRecord, RegistryConfig, and a record built from a node's info."""

from __future__ import annotations

import json

import pytest

from pdserve.config import RegistryConfig
from pdserve.registry import NodeLoadReport, NodeRecord, node_key, node_record
from pdserve.v1 import node_pb2


def record(node_id: str = "n1", **overrides) -> NodeRecord:
    fields = dict(
        node_id=node_id, role="decode", address="127.0.0.1:7001", kv_address="tcp://127.0.0.1:7101",
        model_name="m", layout_hash="abc", protocol_version=1, kv_transport="tcp", block_size=16,
        max_model_len=2048, num_kv_blocks=64, max_num_seqs=8,
        load=NodeLoadReport(num_free_kv_blocks=60, num_running_requests=1), heartbeat_s=0.2,
        ttl_s=0.6, updated_at_s=1.5,
    )  # fmt: skip
    return NodeRecord(**{**fields, **overrides})


def test_a_record_round_trips_through_json() -> None:
    original = record()

    parsed = NodeRecord.from_json(original.to_json().encode())

    assert parsed == original
    assert parsed.key == node_key("n1") == "pdserve:node:n1"
    assert parsed.node_role == node_pb2.NODE_ROLE_DECODE


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda f: f.pop("address"), "missing 'address'"),
        (lambda f: f.update(block_size="16"), "block_size must be int"),
        (lambda f: f.update(num_kv_blocks=True), "num_kv_blocks must be int"),
        (lambda f: f["load"].pop("num_free_kv_blocks"), "missing 'num_free_kv_blocks'"),
        (lambda f: f.update(role="router"), "role must be 'prefill' or 'decode'"),
        (lambda f: f.update(schema_version=2), "schema_version 2, this build reads 1"),
    ],
)
def test_a_bad_record_says_what_is_wrong(change, message) -> None:
    fields = json.loads(record().to_json())
    change(fields)

    with pytest.raises(ValueError, match=message):
        NodeRecord.from_json(json.dumps(fields))
    with pytest.raises(ValueError, match="not JSON"):
        NodeRecord.from_json(b"{oops")


def test_unknown_fields_are_ignored_for_newer_writers() -> None:
    fields = {**json.loads(record().to_json()), "gpu": "H200"}

    assert NodeRecord.from_json(json.dumps(fields)) == record()


def test_registry_config_checks_its_values() -> None:
    with pytest.raises(ValueError, match="must look like redis://HOST:PORT/DB"):
        RegistryConfig("localhost:6379")
    with pytest.raises(ValueError, match="ttl_s .* must exceed heartbeat_s"):
        RegistryConfig("redis://h:1/0", heartbeat_s=1.0, ttl_s=1.0)
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        RegistryConfig("redis://h:1/0", timeout_s=0)


def test_node_record_is_built_from_node_info_and_stats() -> None:
    info = node_pb2.NodeInfo(
        role=node_pb2.NODE_ROLE_PREFILL, model_name="m", layout_hash="h", block_size=4,
        kv_transport="tcp", protocol_version=1, max_model_len=128, max_num_seqs=6,
    )  # fmt: skip
    stats = node_pb2.NodeStats(
        num_kv_blocks=32, num_free_kv_blocks=30, num_running_requests=2,
        num_waiting_requests=3, num_queued_prefill_tokens=40,
    )  # fmt: skip
    config = RegistryConfig("redis://h:1/0")

    made = node_record("id", "10.0.0.1:7001", "tcp://10.0.0.1:7101", info, stats, config)

    assert (made.role, made.address, made.max_num_seqs, made.num_kv_blocks) == (
        "prefill", "10.0.0.1:7001", 6, 32,
    )  # fmt: skip
    assert made.load == NodeLoadReport(30, 2, 3, 40)
    assert (made.heartbeat_s, made.ttl_s) == (config.heartbeat_s, config.ttl_s)
