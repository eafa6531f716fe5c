"""The Redis registry's schema, shared by nodes (which write it) and routers (which read it).

```
key      pdserve:node:<node_id>    one JSON NodeRecord per node, SET with a TTL at every heartbeat
channel  pdserve:node-events       {"event": "join" | "leave", "node_id": ...}
```

`RegistryConfig` says where the registry is and how often nodes refresh their record;
`registry_client` opens a Redis client (each call retried at most once; callers bound every
call with `asyncio.timeout` and retry at their own pace). Torch-free: the router imports it.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from pdserve.config import RegistryConfig
from pdserve.security import ClusterAuth
from pdserve.v1 import node_pb2

NODE_KEY_PREFIX = "pdserve:node:"
NODE_KEY_PATTERN = NODE_KEY_PREFIX + "*"
EVENTS_CHANNEL = "pdserve:node-events"
SCHEMA_VERSION = 1
ROLE_NAMES = {node_pb2.NODE_ROLE_PREFILL: "prefill", node_pb2.NODE_ROLE_DECODE: "decode"}
# What a Redis call raises when Redis is away or slow (redis-py wraps most of it in RedisError).
REGISTRY_ERRORS = (RedisError, OSError, TimeoutError)


@dataclass(frozen=True)
class NodeLoadReport:
    """A node's load when it wrote its record."""

    num_free_kv_blocks: int = 0
    num_running_requests: int = 0
    num_waiting_requests: int = 0
    num_queued_prefill_tokens: int = 0  # prompt tokens accepted but not prefilled yet


@dataclass(frozen=True)
class NodeRecord:
    """What one node publishes about itself (the value of its registry key)."""

    node_id: str
    role: str  # "prefill" | "decode"
    address: str  # gRPC HOST:PORT routers dial
    kv_address: str  # KV transport address, e.g. tcp://10.0.0.7:5600
    model_name: str
    layout_hash: str
    protocol_version: int
    kv_transport: str
    block_size: int
    max_model_len: int
    num_kv_blocks: int  # capacity
    max_num_seqs: int  # capacity: the most requests one engine step batches
    load: NodeLoadReport
    heartbeat_s: float
    ttl_s: float
    updated_at_s: float  # unix time of the write
    schema_version: int = SCHEMA_VERSION
    signature: str = ""  # hex HMAC of the record under the cluster secret (sign_record)

    @property
    def key(self) -> str:
        return node_key(self.node_id)

    @property
    def node_role(self) -> node_pb2.NodeRole:
        return next(value for value, name in ROLE_NAMES.items() if name == self.role)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> NodeRecord:
        """Parses and checks one record; ValueError says what is wrong with it."""
        try:
            fields = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ValueError(f"not JSON: {error}") from None
        if not isinstance(fields, dict):
            raise ValueError(f"expected a JSON object, got {type(fields).__name__}")
        if fields.get("schema_version") != SCHEMA_VERSION:
            raise ValueError(
                f"schema_version {fields.get('schema_version')!r}, this build reads "
                f"{SCHEMA_VERSION}: run one pdserve version per registry"
            )
        load = _typed_fields(NodeLoadReport, fields.get("load"))
        signature = fields.get("signature", "")  # unsigned: an open cluster's node
        fields = {**fields, "load": NodeLoadReport(**load), "signature": signature}
        record = _typed_fields(cls, fields)
        if record["role"] not in ROLE_NAMES.values():
            raise ValueError(f"role must be 'prefill' or 'decode', got {record['role']!r}")
        return cls(**record)


def sign_record(auth: ClusterAuth, record: NodeRecord) -> NodeRecord:
    """`record` with its signature: an HMAC of every other field under the cluster secret."""
    unsigned = dataclasses.replace(record, signature="")
    return dataclasses.replace(
        unsigned, signature=auth.sign("node-record", unsigned.to_json()).hex()
    )


def check_record(auth: ClusterAuth, record: NodeRecord) -> str | None:
    """None when a node that holds the cluster secret wrote `record` within its TTL (and the
    auth window); else why the router must not admit it."""
    try:
        mac = bytes.fromhex(record.signature)
    except ValueError:
        return "its signature is not hex"
    if not record.signature:
        return "it is unsigned (a node without the cluster secret)"
    unsigned = dataclasses.replace(record, signature="").to_json()
    if not auth.verify(mac, "node-record", unsigned):
        return "its signature does not verify (forged, or a different cluster secret)"
    if time.time() - record.updated_at_s > record.ttl_s + auth.window_s:
        return f"it was written {time.time() - record.updated_at_s:.0f} s ago (a replay?)"
    return None


def node_key(node_id: str) -> str:
    return NODE_KEY_PREFIX + node_id


def node_record(
    node_id: str,
    address: str,
    kv_address: str,
    info: node_pb2.NodeInfo,
    stats: node_pb2.NodeStats,
    config: RegistryConfig,
) -> NodeRecord:
    """A node's record from what its `Node` service reports."""
    return NodeRecord(
        node_id=node_id,
        role=ROLE_NAMES[info.role],
        address=address,
        kv_address=kv_address,
        model_name=info.model_name,
        layout_hash=info.layout_hash,
        protocol_version=info.protocol_version,
        kv_transport=info.kv_transport,
        block_size=info.block_size,
        max_model_len=info.max_model_len,
        num_kv_blocks=stats.num_kv_blocks,
        max_num_seqs=info.max_num_seqs,
        load=NodeLoadReport(
            num_free_kv_blocks=stats.num_free_kv_blocks,
            num_running_requests=stats.num_running_requests,
            num_waiting_requests=stats.num_waiting_requests,
            num_queued_prefill_tokens=stats.num_queued_prefill_tokens,
        ),
        heartbeat_s=config.heartbeat_s,
        ttl_s=config.ttl_s,
        updated_at_s=time.time(),
    )


def event_message(event: str, node_id: str) -> str:
    """What a node publishes on EVENTS_CHANNEL when it joins or leaves."""
    return json.dumps({"event": event, "node_id": node_id})


def registry_client(config: RegistryConfig) -> Redis:
    """A Redis client that connects within `config.timeout_s` and retries a failed call once
    at once (a pooled connection to a Redis that restarted fails on first use; a fresh one
    works). Callers bound each call with `asyncio.timeout`: redis-py's own socket_timeout
    goes through `asyncio.wait_for`, which on Python 3.11 can swallow the cancellation of the
    task that awaits it (a stopping router or node would then never stop)."""
    return Redis.from_url(
        config.url,
        socket_timeout=None,
        socket_connect_timeout=config.timeout_s,
        retry=Retry(NoBackoff(), 1),
        decode_responses=False,
    )


def _typed_fields(cls: type, fields: Any) -> dict[str, Any]:
    """`fields` restricted to `cls`'s dataclass fields (all required: writers write every one),
    each checked against its annotation (int, float or str); unknown keys are ignored (newer
    writers may add some)."""
    if not isinstance(fields, dict):
        raise ValueError(f"{cls.__name__}: expected an object, got {type(fields).__name__}")
    kinds: dict[str, type | tuple[type, ...]] = {"int": int, "float": (int, float), "str": str}
    out: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        if field.name not in fields:
            raise ValueError(f"{cls.__name__}: missing {field.name!r}")
        value = fields[field.name]
        kind = kinds.get(str(field.type))  # the annotation's text (postponed annotations)
        if kind is not None and (not isinstance(value, kind) or isinstance(value, bool)):
            raise ValueError(f"{cls.__name__}.{field.name} must be {field.type}, got {value!r}")
        out[field.name] = value
    return out
