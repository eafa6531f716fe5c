"""Every setting of pdserve: one frozen dataclass per concern, each field written once.

```
EngineConfig = ModelConfig + CacheConfig + SchedulerConfig     the engine (both node roles, LLM)
               + SpeculativeConfig + ParallelConfig            (speculative decoding, TP)
NodeConfig                                                     where a node listens, KV transfer
RouterConfig                                                   routing, node addresses, timeouts
RegistryConfig                                                 the Redis registry
SecurityConfig                                                 cluster secret, TLS (all roles)
```

The engine's sections live in `pdserve.engine_config`, `knob` in `pdserve.knobs`; this module
names them all. A field's default, help text and flag live in its `knob(...)`: the launchers'
flags are generated from these dataclasses (`pdserve.cli.add_config_flags`), and the offline
`LLM(**kwargs)` accepts every `EngineConfig` field (`EngineConfig.from_kwargs`). Torch-free;
nothing here reads the environment (see `pdserve.envs`).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine_config import (
    ASYNC_SCHEDULING,
    ATTENTION_BACKENDS,
    DEFAULT_MODEL,
    DTYPES,
    ENGINE_SECTIONS,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from pdserve.knobs import (
    knob,
    parse_size,
    prefill_rate_knob,
    prefix_cache_salt_knob,
    ticket_timeout_knob,
    transfer_timeout_knob,
)
from pdserve.net import redact_url

__all__ = [
    "ASYNC_SCHEDULING", "ATTENTION_BACKENDS", "DEFAULT_HOST", "DEFAULT_HTTP_PORT",
    "DEFAULT_MAX_REQUEST_BYTES", "DEFAULT_MODEL", "DEFAULT_ROUTER_PORT", "DTYPES",
    "ENGINE_SECTIONS", "KV_TRANSPORTS", "POLICY_NAMES", "REGISTRY_URL_SCHEMES", "CacheConfig",
    "EngineConfig", "ModelConfig", "NodeConfig", "ParallelConfig", "RegistryConfig", "RouterConfig",
    "SchedulerConfig", "SecurityConfig", "SpeculativeConfig", "knob", "parse_size",
]  # fmt: skip

DEFAULT_HOST = "127.0.0.1"
DEFAULT_ROUTER_PORT = 50051
DEFAULT_HTTP_PORT = 8000  # the router's OpenAI-compatible API (and /metrics)
# The longest prompt --max-prompt-chars lets through on a 128k-token model (32 x 128k characters)
# fits as UTF-8 text (not as 6-byte \uXXXX escapes), so do 2 M token ids. Larger bodies took the
# event loop longer than 50 ms to read and decode (router/http/json_body.py).
DEFAULT_MAX_REQUEST_BYTES = 16 * 1024 * 1024
KV_TRANSPORTS = ("auto", "ucx", "tcp", "local")
# router.policies.POLICIES
POLICY_NAMES = ("round_robin", "least_loaded", "prefix_aware", "kv_events")


REGISTRY_URL_SCHEMES = ("redis://", "rediss://", "unix://")


@dataclass(frozen=True)
class RegistryConfig:
    """Where the registry is, and the heartbeat that keeps a node's record alive
    (pdserve.registry). The URL may carry Redis ACL credentials and TLS files, as redis-py
    reads them: rediss://USER:PASSWORD@HOST:PORT/DB?ssl_ca_certs=CA.pem&ssl_certfile=C.pem
    &ssl_keyfile=K.pem (logs show `redacted_url`)."""

    url: str  # redis://HOST:PORT/DB
    heartbeat_s: float = 1.0  # nodes refresh their record; routers resync their view
    ttl_s: float = 3.0  # a record not refreshed for this long expires (a dead node vanishes)
    timeout_s: float = 0.5  # a Redis call (connect, command) gives up after this

    def __post_init__(self) -> None:
        if not self.url.startswith(REGISTRY_URL_SCHEMES):
            raise ValueError(
                f"registry URL must look like redis://HOST:PORT/DB (or rediss://, unix://), "
                f"got {self.redacted_url!r}"
            )
        for name in ("heartbeat_s", "ttl_s", "timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"registry {name} must be > 0 seconds, got {getattr(self, name)}")
        if self.ttl_s <= self.heartbeat_s:
            raise ValueError(
                f"registry ttl_s ({self.ttl_s}) must exceed heartbeat_s ({self.heartbeat_s}), "
                "or records expire between heartbeats (use about 3 heartbeats)"
            )

    @property
    def redacted_url(self) -> str:
        return redact_url(self.url)  # what logs and errors show


@dataclass(frozen=True)
class SecurityConfig:
    """Who may talk to whom (pdserve.security): one cluster secret every router and node
    holds, and optional mutual TLS between the router and the nodes. Without a secret the
    cluster is open: any process that reaches a node may call it (the launchers say so)."""

    cluster_secret_file: str | None = knob(
        None,
        "file holding the cluster secret (at least 16 bytes) every router -> node call, KV "
        "hand-off, ticket and registry record is signed with (default: the file named by "
        "PDSERVE_CLUSTER_SECRET_FILE; none: the cluster is open)",
    )
    tls_cert: str | None = knob(None, "PEM certificate this process presents (mutual TLS)")
    tls_key: str | None = knob(None, "PEM private key of --tls-cert")
    tls_ca: str | None = knob(None, "PEM CA bundle peers' certificates must chain to")
    auth_window_s: float = knob(
        60.0, "how old (or how far in the future) a signed call or ticket may be (clock skew)"
    )

    def __post_init__(self) -> None:
        tls = (self.tls_cert, self.tls_key, self.tls_ca)
        if any(tls) and not all(tls):
            raise ValueError(
                "TLS needs all of --tls-cert, --tls-key and --tls-ca (mutual TLS between the "
                f"router and the nodes), got cert={self.tls_cert} key={self.tls_key} "
                f"ca={self.tls_ca}"
            )
        if not self.auth_window_s > 0:
            raise ValueError(f"auth_window_s must be > 0 seconds, got {self.auth_window_s}")

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None


@dataclass(frozen=True)
class NodeConfig:
    """Where a node listens and how it hands KV over (both roles)."""

    host: str = knob(DEFAULT_HOST, "address to listen on", cli=False)  # a common flag
    port: int = knob(0, "gRPC port (0: a free one)", cli=False)  # a common flag
    kv_transport: str = knob("auto", "KV transport (auto: ucx when ucxx imports, else tcp)",
                             choices=KV_TRANSPORTS)  # fmt: skip
    kv_port: int = knob(0, "KV transport port (0: a free one)")
    advertise_host: str | None = knob(
        None,
        "host other nodes use to reach this one (default: --host; set it to the pod IP when "
        "listening on 0.0.0.0)",
    )
    transfer_timeout_s: float = transfer_timeout_knob()
    ticket_timeout_s: float = ticket_timeout_knob()
    min_prefill_tokens_per_s: float = prefill_rate_knob()
    kv_write_in_place: bool = knob(
        True, "turn writes in place off: on one GPU the prefill node then sends the KV instead "
        "of writing it into the decode node's blocks itself over CUDA IPC (default: on)",
    )  # fmt: skip
    kv_encrypt: bool = knob(
        False, "encrypt the KV payloads and first tokens this node sends, take only encrypted "
        "hand-offs (AES-256-CTR under a per-transfer key; host payloads: --kv-transport tcp on "
        "GPU nodes; needs --cluster-secret-file; default: off, they are MACed, not encrypted)",
    )  # fmt: skip
    grace_s: float = knob(5.0, "on stop, how long in-flight calls may take before cancellation")
    metrics_port: int = knob(0, "Prometheus /metrics HTTP port (0: off; pd-serve: node i at N + i)")
    registry: RegistryConfig | None = knob(None, "from the registry flags", cli=False)
    security: SecurityConfig = knob(SecurityConfig(), "from the security flags", cli=False)
    max_queued_requests: int = knob(
        64, "decode: requests that may wait for free KV blocks at once; more are refused "
        "RESOURCE_EXHAUSTED at once",
    )  # fmt: skip
    queue_timeout_s: float = knob(
        10.0, "decode: the longest a request waits for free KV blocks before RESOURCE_EXHAUSTED"
    )
    bind_retry_s: float = knob(
        10.0, "how long to retry a gRPC or KV port that cannot be bound (e.g. still held by a "
        "killed node) before exiting with an error",
    )  # fmt: skip
    max_transfer_timeout_s: float = knob(
        120.0, "decode: a Decode's transfer_timeout_s (its no-progress timeout) is clamped to this"
    )
    max_handoff_s: float = knob(
        1800.0,
        "decode: the longest a KV hand-off may take from its prefill node's handshake, however "
        "long that node says its queue and prefill take (reserved blocks always come back)",
    )
    max_pending_kv_share: float = knob(
        0.75,
        "decode: the fraction of the KV pool one caller (one gRPC connection) may hold in "
        "reservations awaiting KV; beyond it, its next Decode waits (--queue-timeout-s, then "
        "RESOURCE_EXHAUSTED) for its own earlier hand-offs to resolve (1: no per-caller cap)",
    )
    max_pending_transfers: int = knob(
        256, "decode: hand-offs awaited at once, all callers; more: RESOURCE_EXHAUSTED at once"
    )
    suffix_handoff: bool = knob(
        True, "decode: get only KV its prefix cache lacks (default: on)", flag="--no-suffix-handoff"
    )

    def __post_init__(self) -> None:
        caps = (self.max_transfer_timeout_s, self.max_pending_kv_share, self.max_pending_transfers)
        if not (caps[0] > 0 and 0 < caps[1] <= 1 and caps[2] >= 1):
            raise ValueError(
                "max_transfer_timeout_s must be > 0, max_pending_kv_share in (0, 1] and "
                f"max_pending_transfers >= 1, got {caps[0]}, {caps[1]} and {caps[2]}"
            )
        if self.max_queued_requests < 0 or not self.queue_timeout_s > 0:
            raise ValueError(
                f"max_queued_requests must be >= 0 and queue_timeout_s > 0, got "
                f"{self.max_queued_requests} and {self.queue_timeout_s}"
            )
        if not self.bind_retry_s >= 0:
            raise ValueError(f"bind_retry_s must be >= 0, got {self.bind_retry_s}")
        for name in ("port", "kv_port", "metrics_port"):
            value = getattr(self, name)
            if not 0 <= value < 65536:
                raise ValueError(f"{name} must be in [0, 65535] (0: a free port), got {value}")
        waits = ("transfer_timeout_s", "ticket_timeout_s", "min_prefill_tokens_per_s")
        for name in (*waits, "max_handoff_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not self.grace_s >= 0:
            raise ValueError(f"grace_s must be >= 0, got {self.grace_s}")

    @property
    def kv_host(self) -> str:
        """Where the KV transport listens (and what it advertises)."""
        return self.advertise_host or self.host


@dataclass(frozen=True)
class RouterConfig:
    """What one router serves, where its nodes are, how it routes, how long it waits."""

    host: str = knob(DEFAULT_HOST, "address to listen on", cli=False)  # a common flag
    port: int = knob(DEFAULT_ROUTER_PORT, "gRPC port (0: a free one)", cli=False)
    http_port: int = knob(
        DEFAULT_HTTP_PORT, "OpenAI-compatible HTTP API and /metrics, /health on this port (0: off)"
    )
    # none: colocated mode (decode nodes prefill locally); flags --prefill/--decode ADDR
    prefill_addrs: tuple[str, ...] = knob((), "prefill nodes' HOST:PORT", cli=False)
    decode_addrs: tuple[str, ...] = knob((), "decode nodes' HOST:PORT", cli=False)
    registry: RegistryConfig | None = knob(None, "from the registry flags", cli=False)
    policy: str = knob(
        "round_robin",
        "round_robin: each node in turn; least_loaded: fewest outstanding tokens, free KV "
        "blocks; prefix_aware: a shared prompt prefix goes to the prefill node that holds it; "
        "kv_events: the prefill and decode nodes whose prefix caches hold the prompt's longest "
        "prefix, as they report it (WatchKVEvents), weighed against their load",
        choices=POLICY_NAMES,
    )
    local_prefill_max_tokens: int = knob(
        0, "prompts of at most N tokens prefill on their decode node (0: off)"
    )
    prefill_saturation_tokens: int = knob(
        16384,
        "a prefill node with N queued prompt tokens is saturated; when all are, prompts "
        "prefill on their decode node (0: off)",
    )
    node_wait_s: float = knob(60.0, "how long to wait at start for nodes that are not up yet")
    node_rpc_timeout_s: float = knob(5.0, "deadline of GetNodeInfo, GetTokenizer, Abort calls")
    ticket_timeout_s: float = ticket_timeout_knob()
    transfer_timeout_s: float = transfer_timeout_knob()
    min_prefill_tokens_per_s: float = prefill_rate_knob()
    token_timeout_s: float = knob(
        120.0,
        "the longest wait for a request's next token; for its first, plus the prompt tokens "
        "its prefilling node has in flight / --min-prefill-tokens-per-s",
    )
    grace_s: float = knob(5.0, "on stop, how long in-flight requests may take")
    api_key_file: str | None = knob(
        None,
        "file of client API keys, one a line: clients must send 'authorization: Bearer KEY' "
        "(gRPC metadata or HTTP header); none: clients need no key",
    )
    max_prompt_chars: int = knob(
        0, "prompts longer than N characters are refused before tokenizing (0: 32 x the "
        "model's context length)",
    )  # fmt: skip
    max_request_bytes: int = knob(
        DEFAULT_MAX_REQUEST_BYTES,
        "HTTP request bodies larger than N bytes are refused (413) before being read whole",
    )
    http_max_connections: int = knob(
        2048,
        "open HTTP connections at most (kept below the open-file limit); beyond, the oldest one "
        "with no request in flight is closed",
    )
    http_max_requests: int = knob(
        512, "HTTP /v1 requests in flight at most (streams included); beyond, 503 + Retry-After"
    )
    http_header_timeout_s: float = knob(
        15.0, "an HTTP request's headers must arrive within this, else its connection closes"
    )
    http_body_timeout_s: float = knob(
        15.0, "the longest wait for more of an HTTP request's body before its connection closes"
    )
    http_keep_alive_s: float = knob(5.0, "an idle HTTP keep-alive connection closes after this")
    max_choices_per_request: int = knob(
        256,
        "an HTTP request asking for more choices (prompts x n) is refused (400): each runs as "
        "a request of its own",
    )
    prefix_cache_salt: str | None = prefix_cache_salt_knob()
    share_prefix_cache_across_tenants: bool = knob(
        False,
        "with --api-key-file, each API key is a tenant whose prompts never share cached blocks "
        "with another's (no cross-tenant cache-hit oracle); this flag lets them share",
    )
    security: SecurityConfig = knob(SecurityConfig(), "from the security flags", cli=False)

    def __post_init__(self) -> None:
        if self.policy not in POLICY_NAMES:
            raise ValueError(f"unknown policy {self.policy!r}; expected one of {POLICY_NAMES}")
        for name in ("local_prefill_max_tokens", "prefill_saturation_tokens", "max_prompt_chars"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0: off), got {getattr(self, name)}")
        for name in ("max_request_bytes", "max_choices_per_request", "http_max_connections",
                     "http_max_requests"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("port", "http_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise ValueError(f"{name} must be in [0, 65535], got {getattr(self, name)}")
        waits = ("node_wait_s", "node_rpc_timeout_s", "ticket_timeout_s", "transfer_timeout_s",
                 "min_prefill_tokens_per_s", "token_timeout_s", "http_header_timeout_s",
                 "http_body_timeout_s", "http_keep_alive_s")  # fmt: skip
        for name in waits:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.grace_s < 0:
            raise ValueError(f"grace_s must be >= 0 seconds, got {self.grace_s}")
        addrs = [*self.prefill_addrs, *self.decode_addrs]
        if any(not a or ":" not in a for a in addrs):
            raise ValueError(f"node addresses must be HOST:PORT, got {addrs}")
        if len(set(addrs)) != len(addrs):
            raise ValueError(f"a node address is listed twice: {addrs}")
